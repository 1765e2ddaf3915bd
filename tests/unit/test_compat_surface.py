"""The DeepSpeed-shaped names, in one process: each is backed by zeroshard's machinery and behaves as
DeepSpeed's does (the multi-process paths are in tests/distributed/test_ds_scripts.py)."""

import argparse
import json

import pytest
import torch
from torch import nn

import zeroshard as deepspeed
from zeroshard.accelerator import get_accelerator
from zeroshard.moe.utils import split_params_into_different_moe_groups_for_optimizer
from zeroshard.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zeroshard.runtime.lr_schedules import VALID_LR_SCHEDULES
from zeroshard.runtime.zero.partition_parameters import ZeroParamStatus
from zeroshard.utils import RepeatingLoader


def config(stage: int = 1, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}, **extra}


def engine_for(model: nn.Module, stage: int = 1, **extra):
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage, **extra))
    return engine


def test_accelerator_on_cpu() -> None:
    acc = get_accelerator()
    assert (acc.device_name(), acc.current_device_name(), acc.communication_backend_name()) == ("cpu", "cpu", "gloo")
    assert acc.is_available() and acc.device_count() >= 1 and acc.is_bf16_supported() and acc.is_fp16_supported()
    acc.manual_seed_all(3)
    first = torch.rand(2)
    acc.manual_seed(3)
    assert torch.equal(first, torch.rand(2))
    assert 0 < acc.memory_allocated() <= acc.max_memory_allocated()
    acc.synchronize()
    acc.set_device(0)


def test_comm_in_a_world_of_one() -> None:
    assert (deepspeed.comm.get_rank(), deepspeed.comm.get_world_size(), deepspeed.comm.get_local_rank()) == (0, 1, 0)
    t = torch.ones(3)
    deepspeed.comm.all_reduce(t)
    deepspeed.comm.barrier()
    out = [torch.zeros(3)]
    deepspeed.comm.all_gather(out, t)
    assert torch.equal(out[0], t)
    with pytest.raises(ValueError, match="give both a rank and a world size"):  # before any connection
        deepspeed.init_distributed(init_method="tcp://127.0.0.1:1", rank=0)


def test_add_config_arguments_and_initialize_from_args(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config(2)))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    model = nn.Linear(4, 3)
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model,
                                                                model_parameters=model.parameters())
    assert engine.zero_optimization_stage() == 2 and loader is None and scheduler is None
    assert engine.config["zero_optimization"]["stage"] == 2 and engine.config["train_batch_size"] == 4
    with pytest.raises(ValueError, match="args.deepspeed_config"):
        deepspeed.initialize(args=args, model=nn.Linear(4, 3), config=config(1))
    with pytest.raises(ValueError, match="mpu"):
        deepspeed.initialize(model=nn.Linear(4, 3), config=config(1), mpu=object())


def test_engine_accessors_and_forwarding() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    engine = engine_for(model, bf16={"enabled": True})
    assert (engine.local_rank, engine.global_rank, engine.world_size, engine.device) == (0, 0, 1, torch.device("cpu"))
    assert engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert [n for n, _ in engine.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert len(list(engine.parameters())) == 4 and len(list(engine.named_modules())) == 4
    assert engine.training is True and engine.extra_repr == model.extra_repr  # forwarded to the module
    assert engine.state_dict().keys() == model.state_dict().keys()
    with pytest.raises(AttributeError, match="neither the engine nor its module"):
        engine.no_such_thing
    assert engine.optimizer.overflow is False and engine.was_step_applied()
    with pytest.raises(NotImplementedError, match="offload_optimizer"):
        engine.offload_states()


def test_backward_scale_wrt_gas_and_the_accumulation_boundary() -> None:
    def grads(scale_wrt_gas: bool) -> torch.Tensor:
        torch.manual_seed(0)
        engine = engine_for(nn.Linear(3, 1, bias=False), stage=0)
        loss = engine(torch.ones(2, 3)).sum()
        engine.backward(loss, scale_wrt_gas=scale_wrt_gas)
        return engine.strategy.owned_grad(engine.storage.layout.buckets[0]).clone()

    torch.testing.assert_close(grads(False), 2 * grads(True))
    engine = engine_for(nn.Linear(3, 1))
    assert not engine.is_gradient_accumulation_boundary()  # micro step 1 of 2
    engine.set_gradient_accumulation_boundary(True)  # Accelerate decides
    assert engine.is_gradient_accumulation_boundary()
    engine.backward(engine(torch.ones(2, 3)).sum())
    engine.step()
    assert engine.global_steps == 1
    engine.set_gradient_accumulation_boundary(False)
    assert not engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(None)  # back to the count: micro step 2 of 2
    assert engine.micro_steps == 1 and engine.is_gradient_accumulation_boundary()


def test_checkpoint_tags_of_any_type_and_the_rng_rule(tmp_path) -> None:
    engine = engine_for(nn.Linear(3, 2))
    engine.save_checkpoint(tmp_path, tag=7)
    assert (tmp_path / "7" / "manifest.json").is_file()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    engine.load_checkpoint(tmp_path, tag=7)  # the script owns its data: its RNG is left alone
    assert torch.equal(torch.rand(3), expected)
    torch.manual_seed(123)
    engine.load_checkpoint(tmp_path, tag=7, load_rng_state=True)  # asked for: the saved generator is back
    assert not torch.equal(torch.rand(3), expected)


def test_save_16bit_model_writes_what_the_file_name_says(tmp_path) -> None:
    model = nn.Linear(3, 2)
    engine = engine_for(model, bf16={"enabled": True})
    engine.save_16bit_model(tmp_path, "pytorch_model.bin")
    state = torch.load(tmp_path / "pytorch_model.bin")
    assert state.keys() == {"weight", "bias"} and state["weight"].dtype == torch.bfloat16
    from safetensors.torch import load_file

    engine.save_16bit_model(tmp_path, "model.safetensors")
    assert load_file(str(tmp_path / "model.safetensors"))["bias"].dtype == torch.bfloat16


def test_stage3_save_16bit_model_follows_the_gather_key(tmp_path) -> None:
    engine = engine_for(nn.Linear(3, 2), stage=3)
    assert not engine.zero_gather_16bit_weights_on_model_save()
    assert engine.save_16bit_model(tmp_path) is None and not (tmp_path / "model.safetensors").exists()
    engine = engine_for(nn.Linear(3, 2), stage=3,
                        zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": True})
    written = tmp_path / "model.safetensors"
    assert engine.save_16bit_model(tmp_path) == written and written.is_file()
    assert set(engine._zero3_consolidated_16bit_state_dict()) == {"weight", "bias"}


def test_ops_optimizers_are_torch_fused_adam() -> None:
    def run(make) -> torch.Tensor:
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(10))
        opt = make([p])
        for _ in range(3):
            p.grad = torch.ones(10)
            opt.step()
        return p.detach()

    reference = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    assert torch.equal(run(lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1)), reference)
    assert torch.equal(run(lambda ps: DeepSpeedCPUAdam(ps, lr=1e-2, weight_decay=0.1)), reference)
    l2 = run(lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1))
    assert torch.equal(run(lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=False)), l2)


def test_utils_moe_runtime_and_refusals() -> None:
    assert [next(iter(RepeatingLoader([1, 2]))) for _ in range(1)] == [1]
    loader = RepeatingLoader([1, 2])
    assert [next(loader) for _ in range(5)] == [1, 2, 1, 2, 1]
    groups = [{"params": [nn.Parameter(torch.zeros(2))], "weight_decay": 0.0}]
    assert split_params_into_different_moe_groups_for_optimizer(groups) == groups
    assert {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"} <= set(VALID_LR_SCHEDULES)
    assert ZeroParamStatus.AVAILABLE != ZeroParamStatus.NOT_AVAILABLE
    with pytest.raises(ValueError, match="num_stages"):
        deepspeed.pipe.PipelineModule(layers=[nn.Linear(2, 2)])
    from zeroshard.moe.layer import MoE

    MoE(hidden_size=4, expert=nn.Linear(4, 4))  # expert-parallel size 1: every expert on every rank
    with pytest.raises(ValueError, match="positive divisor of num_experts"):
        MoE(hidden_size=4, expert=nn.Linear(4, 4), num_experts=3, ep_size=2)
    spread = MoE(hidden_size=4, expert=nn.Linear(4, 4), num_experts=2, ep_size=2)  # one expert per rank
    assert spread.num_local_experts == 1
    with pytest.raises(ValueError, match="expert-parallel group, which zeroshard.initialize"):
        spread(torch.zeros(3, 4))  # its groups come from initialize()
    with pytest.raises(ValueError, match="mpu"):
        deepspeed.zero.Init(mpu=object())


def test_gathered_parameters_on_init_and_plain_parameters() -> None:
    with deepspeed.zero.Init():
        inside = nn.Linear(3, 2)
    plain = nn.Linear(3, 2)
    with deepspeed.zero.GatheredParameters([inside.weight, plain.weight, inside.bias, None], modifier_rank=0):
        inside.weight.data.fill_(2.0)
        plain.weight.data.fill_(3.0)
    with deepspeed.zero.GatheredParameters(inside.weight):
        assert torch.equal(inside.weight.data, torch.full((2, 3), 2.0))
    assert inside.weight.device == torch.device("cpu") and inside.weight.is_floating_point()


def test_deepspeed_checkpointing_signatures() -> None:
    from zeroshard.activations import checkpointing as activation_checkpointing

    try:
        assert not deepspeed.checkpointing.is_configured()
        deepspeed.checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"profile": True}},
                                          checkpoint_in_cpu=True)
        assert deepspeed.checkpointing.is_configured()
        settings = activation_checkpointing.current().settings
        assert settings.profile and settings.cpu_checkpointing
        layer = nn.Linear(3, 3)
        x = torch.ones(2, 3, requires_grad=True)
        deepspeed.checkpointing.checkpoint(layer, x).sum().backward()
        assert x.grad is not None and activation_checkpointing.take_profile().regions == 1
        with pytest.raises(ValueError, match="model parallelism"):
            deepspeed.checkpointing.configure(object())
        with pytest.raises(Exception, match="partition_activations"):
            deepspeed.checkpointing.configure(None, partition_activations=True)
    finally:
        activation_checkpointing.use_settings(None)
