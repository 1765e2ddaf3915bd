"""A training script written the way DeepSpeed's tutorials and examples write them (getting-started,
zero.md, the CIFAR example), with only the import changed: ``import zeroshard as deepspeed``.

    torchrun --nproc_per_node 2 train_ds_style.py --deepspeed --deepspeed_config ds.json --out losses.json

``--native`` trains the same model on the same data through zeroshard's own API instead (a plain
construction, ``zeroshard.initialize(config=dict)``), the reference the compat path must equal.
With ``--import-deepspeed`` the script does ``import deepspeed`` (run it with
``zeroshard run --as-deepspeed``).
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

if "--import-deepspeed" in sys.argv:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
else:
    import zeroshard as deepspeed
    from zeroshard.accelerator import get_accelerator

IN, HIDDEN, CLASSES = 12, 40, 7


def add_argument():
    parser = argparse.ArgumentParser(description="a DeepSpeed-style script")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--start_step", type=int, default=0, help="resume: the step to start from")
    parser.add_argument("--save_dir")
    parser.add_argument("--load_dir")
    parser.add_argument("--export_dir")
    parser.add_argument("--out", required=True)
    parser.add_argument("--native", action="store_true")
    parser.add_argument("--import-deepspeed", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def head_init() -> torch.Tensor:
    return torch.randn(CLASSES, HIDDEN, generator=torch.Generator().manual_seed(7)) * 0.05


class Net(nn.Module):
    def __init__(self, modify_on_rank0: bool = True):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU())
        self.head = nn.Linear(HIDDEN, CLASSES)
        if modify_on_rank0:  # zero.md: change a (possibly partitioned) weight on one rank, in __init__
            with deepspeed.zero.GatheredParameters(self.head.weight, modifier_rank=0):
                if deepspeed.comm.get_rank() == 0:
                    self.head.weight.data.copy_(head_init())
        else:
            with torch.no_grad():
                self.head.weight.copy_(head_init())

    def forward(self, x):
        return self.head(self.body(x))


def batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(micro, IN, generator=g), torch.randint(0, CLASSES, (micro,), generator=g)


def main():
    args = add_argument()
    if args.import_deepspeed:  # launched by `zeroshard run --as-deepspeed`, as by the deepspeed launcher
        assert args.local_rank == int(os.environ["LOCAL_RANK"]), (args.local_rank, os.environ["LOCAL_RANK"])
    config = json.load(open(args.deepspeed_config))
    if args.native:
        import zeroshard

        torch.manual_seed(0)
        engine, _, _, _ = zeroshard.initialize(model=Net(modify_on_rank0=False), config=config)
        rank = engine.world.rank
    else:
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        rank = deepspeed.comm.get_rank()
        get_accelerator().set_device(max(args.local_rank, 0))
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config,
                                 enabled=config["zero_optimization"]["stage"] == 3):
            net = Net()
        parameters = filter(lambda p: p.requires_grad, net.parameters())
        engine, optimizer, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=parameters)
        assert engine.world_size == deepspeed.comm.get_world_size() and engine.global_rank == rank
        assert engine.zero_optimization_stage() == config["zero_optimization"]["stage"]
        assert not engine.fp16_enabled() and engine.bfloat16_enabled() == config.get("bf16", {}).get("enabled", False)
    device = get_accelerator().device_name(engine.local_rank) if get_accelerator().device_name() == "cuda" else "cpu"
    if args.load_dir:
        _, client = engine.load_checkpoint(args.load_dir)
        assert client["step"] == args.start_step, client
    losses = []
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(args.start_step, args.steps):
        for m in range(engine.gradient_accumulation_steps()):
            x, y = batch(step * 10 + m, rank, micro)
            loss = F.cross_entropy(engine(x.to(device)), y.to(device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    if args.save_dir:
        engine.save_checkpoint(args.save_dir, tag=args.steps, client_state={"step": args.steps})  # an int tag
    if args.export_dir:
        engine.save_16bit_model(args.export_dir, "pytorch_model.bin")
        state = engine._zero3_consolidated_16bit_state_dict() if engine.zero_optimization_stage() == 3 \
            else engine.module.state_dict()
        if rank == 0:
            torch.save({k: v.float() for k, v in state.items()}, f"{args.export_dir}/consolidated.pt")
    if rank == 0:
        json.dump({"losses": losses, "lr": engine.get_lr()}, open(args.out, "w"))


if __name__ == "__main__":
    main()
