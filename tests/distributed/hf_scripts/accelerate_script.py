"""An Accelerate training loop with a DeepSpeed plugin, as its users write it, on zeroshard.

    torchrun --nproc_per_node 2 accelerate_script.py --stage 2 --out DIR [--ddp] [--dynamo inductor]

``zeroshard.install_as_deepspeed()`` first; then plain Accelerate: ``prepare``, ``accumulate``,
``backward``, ``save_state`` / ``load_state``.  ``--ddp`` is the same loop without the plugin;
``--dynamo BACKEND`` is Accelerate's ``dynamo_backend``, which compiles a DeepSpeed engine through
``engine.compile(backend=..., compile_kwargs=...)``.
(On a CPU-only machine Accelerate picks DeepSpeed only after a CPU ``PartialState`` exists, exactly
as Hugging Face's Trainer sets it up.)
"""

import argparse
import gc
import json
import os

import zeroshard

zeroshard.install_as_deepspeed()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator, PartialState  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--dynamo", default="no")
    a = p.parse_args()
    PartialState(cpu=True)
    plugin = None if a.ddp else DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": a.stage}})
    acc = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=2, dynamo_backend=a.dynamo)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = [(torch.randn(8, generator=torch.Generator().manual_seed(i)),
             torch.randint(0, 4, (), generator=torch.Generator().manual_seed(i))) for i in range(64)]
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    losses = []
    for x, y in loader:
        with acc.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    acc.save_state(os.path.join(a.out, "state"))
    acc.wait_for_everyone()  # (DDP: rank 0 alone writes the files)
    acc.load_state(os.path.join(a.out, "state"))
    gathered = acc.gather(torch.tensor(losses)).tolist()
    if acc.is_main_process:
        json.dump({"losses": gathered, "wrapped": type(model).__name__, "processes": acc.num_processes,
                   "compiled": bool(getattr(model, "is_compiled", False))},
                  open(os.path.join(a.out, "result.json"), "w"))
    if a.ddp:  # the reference ends as PyTorch recommends (zeroshard does this for its own runs at exit)
        del model, optimizer, loader, acc
        gc.collect()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
