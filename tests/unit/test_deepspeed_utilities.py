"""DeepSpeed's utility API as zeroshard answers it: ZeRO-3 leaf-module marks (and the units they make),
the LR-schedule constants and flag helpers, ``required_torch_version``, ``git_version_info``, the
accelerator's support and CPU device count, and the op builders."""

from __future__ import annotations

import argparse
import importlib

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.accelerator import CPUAccelerator, is_current_accelerator_supported
from zeroshard.ops.op_builder import (ALL_OPS, AsyncIOBuilder, CPUAdamBuilder, FusedAdamBuilder, FusedLambBuilder,
                                      OpNotBuiltError, TransformerBuilder)
from zeroshard.runtime import lr_schedules
from zeroshard.sharding.stage3.units import plan_units
from zeroshard.utils import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                             set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)
from zeroshard.utils.torch import required_torch_version


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.moe = Experts()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def unit_names(model: nn.Module) -> list[str]:
    params = [p for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    plan = plan_units(model, params, names, [0] * len(params), 0, 10**6, 1)
    return sorted(u.name for u in plan.units)


# ---------------------------------------------------------------------- leaf modules
def test_a_leaf_module_is_one_unit_and_its_children_have_none() -> None:
    model = Model()
    assert unit_names(model) == ["<root>", "blocks.0", "blocks.1", "moe.experts.0", "moe.experts.1", "moe.experts.2"]
    assert set_z3_leaf_modules(model, [Experts]) == [model.moe]
    assert unit_names(model) == ["<root>", "blocks.0", "blocks.1", "moe"]
    set_z3_leaf_module(model, True)  # the whole model: the root unit only
    assert unit_names(model) == ["<root>"]


def test_leaf_marks_by_class_name_module_name_and_suffix() -> None:
    model = Model()
    assert not z3_leaf_module(model.moe) and get_z3_leaf_modules(model) == []
    assert set_z3_leaf_modules(model, ["Experts"]) == [model.moe]
    assert z3_leaf_module(model.moe) and not hasattr(model.moe, "_z3_leaf")  # no attribute on the module
    assert z3_leaf_parameter(model.moe.experts[1].weight) and not z3_leaf_parameter(model.embed.weight)
    assert unset_z3_leaf_modules(model, [f"{__name__}.Experts"]) == [model.moe]
    assert get_z3_leaf_modules(model) == []
    found, missing = set_z3_leaf_modules_by_name(model, ["blocks.0", "nope"], raise_if_not_found=False)
    assert found == [model.blocks[0]] and missing == ["nope"]
    found, missing = set_z3_leaf_modules_by_suffix(model, ["experts.2"])
    assert found == [model.moe.experts[2]] and missing == []
    assert get_z3_leaf_modules(model) == [model.moe.experts[2], model.blocks[0]]
    with pytest.raises(ValueError):
        set_z3_leaf_modules(model, [nn.Conv2d])
    assert set_z3_leaf_modules(model, [nn.Conv2d], raise_if_not_found=False) == []
    with pytest.raises(ValueError):
        set_z3_leaf_modules_by_name(model, ["nope"])


# ---------------------------------------------------------------------- LR schedules
def test_lr_schedule_constants_are_deepspeeds_strings() -> None:
    assert (lr_schedules.WARMUP_LR, lr_schedules.WARMUP_DECAY_LR, lr_schedules.WARMUP_COSINE_LR,
            lr_schedules.ONE_CYCLE, lr_schedules.LR_RANGE_TEST) == (
        "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
    assert set(lr_schedules.VALID_LR_SCHEDULES) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle",
                                                     "LRRangeTest"}
    # each parameter constant is its lower-case name (the config key), but the two warmup curves
    for name in ("WARMUP_MIN_LR", "WARMUP_MAX_LR", "WARMUP_NUM_STEPS", "WARMUP_TYPE", "TOTAL_NUM_STEPS",
                 "WARMUP_MIN_RATIO", "COS_MIN_RATIO", "LR_RANGE_TEST_MIN_LR", "LR_RANGE_TEST_STEP_RATE",
                 "LR_RANGE_TEST_STEP_SIZE", "LR_RANGE_TEST_STAIRCASE", "CYCLE_FIRST_STEP_SIZE", "CYCLE_MIN_LR",
                 "CYCLE_MAX_LR", "CYCLE_MIN_MOM", "CYCLE_MAX_MOM", "DECAY_LR_RATE", "DECAY_MOM_RATE",
                 "DECAY_STEP_SIZE", "EDGE_VALUE", "MID_VALUE", "LR_SCHEDULE"):
        assert getattr(lr_schedules, name) == name.lower(), name
    assert (lr_schedules.WARMUP_LOG_RATE, lr_schedules.WARMUP_LINEAR_RATE) == ("log", "linear")


def test_lr_schedule_flags_make_a_scheduler_block_that_trains() -> None:
    parser = lr_schedules.add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--lr_schedule", "WarmupDecayLR", "--warmup_max_lr", "0.5", "--warmup_num_steps", "3"])
    config, error = lr_schedules.get_config_from_args(args)
    assert error is None and config is not None
    assert config["type"] == "WarmupDecayLR" and config["params"]["warmup_max_lr"] == 0.5
    assert config["params"]["warmup_num_steps"] == 3 and "cycle_min_lr" not in config["params"]
    assert lr_schedules.get_lr_from_config(config) == (0.5, "")
    assert lr_schedules.get_lr_from_config({"type": "WarmupCosineLR", "params": {}})[0] is None
    assert lr_schedules.get_config_from_args(parser.parse_args([]))[0] is None
    params: dict = {}
    lr_schedules.override_params(args, params)
    assert params["warmup_max_lr"] == 0.5 and params["lr_range_test_min_lr"] == 0.001
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    assert lr_schedules.get_torch_optimizer(optimizer) is optimizer
    assert lr_schedules.update_lr(optimizer.param_groups, [0.25]) == [0.25]
    with pytest.raises(TypeError):
        lr_schedules.get_torch_optimizer(object())
    scheduler = lr_schedules.WarmupDecayLR(optimizer, total_num_steps=10, **config["params"])
    assert scheduler.get_last_lr()[0] == pytest.approx(config["params"]["warmup_min_lr"])


# ---------------------------------------------------------------------- versions, accelerator, ops
def test_required_torch_version() -> None:
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert required_torch_version(min_version=f"{major}.{minor}") and required_torch_version(min_version=1.0)
    assert not required_torch_version(min_version=f"{major + 1}.0")
    assert not required_torch_version(max_version=f"{major - 1}.9")
    assert required_torch_version(min_version=1.0, max_version=f"{major + 1}.0")
    with pytest.raises(ValueError):
        required_torch_version()


def test_git_version_info() -> None:
    info = importlib.import_module("zeroshard.git_version_info")
    assert info is zeroshard.git_version_info and info.version == "0.18.2"
    assert info.git_hash == info.git_branch == "[none]"
    assert info.installed_ops == dict.fromkeys(ALL_OPS, False) and "cpu_adam" in info.installed_ops
    assert info.accelerator_name == zeroshard.accelerator.get_accelerator().device_name()
    assert info.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert set(info.torch_info) >= {"version", "cuda_version", "nccl_version", "hip_version"}


def test_accelerator_support_and_cpu_device_count(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    assert is_current_accelerator_supported()
    cpu = CPUAccelerator()
    monkeypatch.setenv("LOCAL_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu.device_count() == 3  # DeepSpeed's launcher's count first
    monkeypatch.delenv("LOCAL_SIZE")
    assert cpu.device_count() == 2  # then torchrun's
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    from zeroshard.device import accelerator

    for node, cores in (("node0", "0-3\n"), ("node1", "4-7\n"), ("node2", "\n")):  # node2: memory only
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cores)
    assert accelerator._numa_nodes_with_cores(str(tmp_path)) == 2
    assert cpu.device_count() >= 1


def test_op_builders_build_nothing_and_say_what_zeroshard_uses() -> None:
    assert CPUAdamBuilder.NAME == "cpu_adam" and FusedAdamBuilder().name == "fused_adam"
    assert ALL_OPS["async_io"].__class__ is AsyncIOBuilder
    assert CPUAdamBuilder().is_compatible() and FusedAdamBuilder().is_compatible() and AsyncIOBuilder().is_compatible()
    assert not FusedLambBuilder().is_compatible() and not TransformerBuilder().is_compatible()
    assert zeroshard.ops.__compatible_ops__ == {name: b.is_compatible() for name, b in ALL_OPS.items()}
    with pytest.raises(OpNotBuiltError, match="fused=True"):
        FusedAdamBuilder().load()
    with pytest.raises(OpNotBuiltError, match="no counterpart"):
        FusedLambBuilder().load()


def test_leaf_module_config_marks_modules_at_initialize() -> None:
    """``zero_optimization.leaf_module``: classes (short or qualified names), names and suffixes are
    marked when the engine is built, as set_z3_leaf_modules would mark them."""
    import torch
    from torch import nn

    import zeroshard
    from zeroshard.deepspeed.utils.z3_leaf_module import z3_leaf_module

    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    model = nn.Sequential(Expert(), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4))
    leaf = {"classes": [f"{Expert.__module__}.{Expert.__qualname__}"], "names": ["1.0"], "name_suffixes": ["2"]}
    config = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "leaf_module": leaf}}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    assert [z3_leaf_module(m) for m in (model[0], model[1][0], model[2], model[1], model[1][1], model[0].fc)] == [
        True, True, True, False, False, False]
    x = torch.randn(1, 4)
    engine.backward(engine(x).sum())
    engine.step()
    engine.close()
