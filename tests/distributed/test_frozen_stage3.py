"""Stage 3 shards frozen parameters too (a LoRA job's base model): gathered and released like the
trainable ones, never reduced or updated, each rank holding its share; training equals one process
on the whole global batch, and checkpoints save, resume, reshard and consolidate them.

One world per world size runs its cases in turn (``run_family``), each from the same seed, in a
directory of its own, with engines it closes; then one process loads the LoRA run's checkpoint at
stage 2.  The test checks every case, and a failure names the case: its check, stage, world size,
precision and arguments.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from zs_common import CLIP, LR, TINY, WD, global_batch, rank_micro_batches, zero_config

import zeroshard
from zeroshard.checkpoint.consolidate import full_state_dict
from zeroshard.tools.demo.model import GPT
from zeroshard.tools.testing import Case, case, case_directory, check_family, run_family, run_world

STEPS, MICRO, ACCUM = 3, 2, 2

class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (what peft's LoRA layer computes)."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


def lora_model(seed: int = 0) -> nn.Module:
    """The tests' tiny GPT, everything frozen, LoRA on every block's fc and proj."""
    torch.manual_seed(seed)
    model = GPT(TINY)
    model.requires_grad_(False)
    torch.manual_seed(seed + 100)
    for block in model.blocks:
        block.fc = LoRALinear(block.fc)
        block.proj = LoRALinear(block.proj)
    return model


def lora_config(stage: int, **zero: Any) -> dict:
    extra = {"stage3_param_persistence_threshold": 40} if stage == 3 else {}
    return zero_config(stage, MICRO, ACCUM, **extra, **zero)


def reference(world: int) -> dict[str, torch.Tensor]:
    model = lora_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    per_rank = MICRO * ACCUM
    for step in range(STEPS):
        x, y = global_batch(step, per_rank * world)
        for m in range(ACCUM):
            rows = torch.cat([torch.arange(r * per_rank + m * MICRO, r * per_rank + (m + 1) * MICRO)
                              for r in range(world)])
            (model(x[rows], y[rows]) / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(engine: Any, first: int, last: int, world: int) -> None:
    for step in range(first, last):
        for x, y in rank_micro_batches(step, engine.world.rank, world, MICRO, ACCUM):
            engine.backward(engine(x, y))
            engine.step()


def lora_worker(rank: int, world: int, directory: str, host_page_reuse: bool = True) -> dict:
    config = lora_config(3, host_page_reuse=host_page_reuse)
    engine, _, _, _ = zeroshard.initialize(model=lora_model(), config=config)
    storage = engine.storage
    frozen_buckets = [b for b in storage.layout.buckets if b.frozen]
    frozen_names = {s.name for b in frozen_buckets for s in b.slots}
    train(engine, 0, STEPS - 1, world)
    engine.save_checkpoint(directory, tag="mid")
    train(engine, STEPS - 1, STEPS, world)
    named = dict(engine.module.named_parameters())
    # between steps no rank holds a frozen bucket (or any of its parameters) whole
    held = {s.name: storage.params[s.index].untyped_storage().nbytes() for b in frozen_buckets for s in b.slots}
    buckets_held = {f"bucket{b.index}": storage.held_bytes(b.index) for b in frozen_buckets}  # measured
    parked = storage.buffer_memory.parked_bytes
    with zeroshard.GatheredParameters([p for p in storage.params if not p.requires_grad]):
        held_gathered = sum(storage.held_bytes(b.index) for b in frozen_buckets)  # the measure sees them
    out = {"frozen_names": sorted(frozen_names), "held": held, "buckets_held": buckets_held, "parked": parked,
           "memory": engine.memory_breakdown(), "buffer_memory": type(storage.buffer_memory).__name__,
           "held_gathered": held_gathered,
           "shard_frozen": sum(b.real_numel_in_shard(engine.strategy.world.rank) for b in frozen_buckets) * 4,
           "frozen_sharded_total": sum(b.numel for b in frozen_buckets) * 4,
           "frozen_padded_total": sum(b.padded_numel for b in frozen_buckets) * 4,
           "whole_frozen": sum(p.numel() * 4 for n, p in named.items() if not p.requires_grad
                               and n not in frozen_names),
           "optimizer_numel": sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"]),
           "state": engine.full_state_dict(rank0_only=False)}
    engine.close()
    resumed, _, _, _ = zeroshard.initialize(model=lora_model(seed=9), config=config)
    resumed.load_checkpoint(directory, tag="mid")
    train(resumed, STEPS - 1, STEPS, world)
    out["resumed"] = resumed.full_state_dict(rank0_only=False)
    resumed.save_checkpoint(directory, tag="lora_only", exclude_frozen_parameters=True)
    resumed.close()
    return out


def check_stage3_shards_the_frozen_base_and_trains_lora_as_one_process(
        results: list[dict], directory: Path, loaded: dict[str, torch.Tensor], host_page_reuse: bool = True) -> None:
    """``loaded``: what a plain stage-2 single process loaded from the first LoRA case's "mid" save
    (``load_into_stage2``).  With ``host_page_reuse`` false (the GPU's path: [Note: one buffer memory per
    engine] in host/buffer_memory.py) a released bucket's storage is freed, to the byte, and the run
    saves bitwise what the host's path saves."""
    world = len(results)
    expected = reference(world)
    for rank, result in enumerate(results):
        for name, value in expected.items():
            torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
            assert torch.equal(result["resumed"][name], result["state"][name]), name  # resumed bitwise
        # the base's large weights are sharded: no rank holds one whole between steps
        assert {n for n in result["frozen_names"]} >= {k for k in expected if ".base." in k and k.endswith("weight")}
        assert all(nbytes == 0 for nbytes in result["held"].values()), result["held"]
        if host_page_reuse:
            # what the buckets' buffers still have resident is parked for the next gather, not held
            # (see [Note: released pages move to the next gather] in host/page_reserve.py)
            assert result["buffer_memory"] == "HostPageMemory"
            assert sum(result["buckets_held"].values()) <= result["parked"], (result["buckets_held"], result["parked"])
        else:
            assert result["buffer_memory"] == "DeviceMemory"
            assert all(held == 0 for held in result["buckets_held"].values()) and result["parked"] == 0
            assert result["memory"]["parked_pages"] == 0
        assert result["held_gathered"] > 0
        memory = result["memory"]
        assert memory["frozen_params"] == result["shard_frozen"] + result["whole_frozen"]
        assert result["shard_frozen"] <= result["frozen_padded_total"] // world  # 1/N of the frozen base
        # the optimizer sees only the LoRA parameters (and what else trains): never a frozen one
        trainable = sum(v.numel() for k, v in expected.items() if "lora_" in k)
        assert result["optimizer_numel"] <= trainable
    assert sum(r["shard_frozen"] for r in results) == results[0]["frozen_sharded_total"] > 0
    # the frozen base is in the checkpoint, whole, and consolidates; "lora_only" left it out
    saved = full_state_dict(directory / "mid")
    assert set(saved) == set(expected)
    light = full_state_dict(directory / "lora_only")
    assert not any(".base." in k for k in light) and any("lora_" in k for k in light)
    # a plain stage-2 single process loads the sharded-frozen checkpoint (reshard), frozen base included
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name


def load_into_stage2(rank: int, world: int, directory: str) -> dict:
    with case(check=LORA, stage=2, world=world, directory=directory):
        engine, _, _, _ = zeroshard.initialize(model=lora_model(seed=3), config=zero_config(2, 1, 1))
        engine.load_checkpoint(directory, tag="mid")
        state = engine.full_state_dict()
        engine.close()
    return state


def init_worker(rank: int, world: int, directory: str, dtype: str) -> dict:
    config = lora_config(3)
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    with zeroshard.Init(config=config):
        model = lora_model()
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    frozen = [b for b in engine.storage.layout.buckets if b.frozen]
    out = {"initial": engine.full_state_dict(rank0_only=False), "dtype": str(engine.storage.shard.dtype),
           "frozen_buckets": len(frozen)}
    train(engine, 0, 1, world)
    out["after"] = engine.full_state_dict(rank0_only=False)
    engine.close()
    return out


def check_frozen_parameters_built_under_init_are_sharded_from_the_start(results: list[dict], directory: Path,
                                                                         dtype: str) -> None:
    expected = lora_model().state_dict()
    for result in results:
        if dtype == "fp32":
            assert result["frozen_buckets"] > 0
            for name, value in expected.items():
                assert torch.equal(result["initial"][name], value), name
        else:  # frozen shards in the training dtype
            assert result["dtype"] == "torch.bfloat16"
            for name, value in expected.items():
                if ".base." in name:  # never updated: the bf16 rounding of the initial values
                    assert torch.equal(result["after"][name], value.to(torch.bfloat16)), name


LORA = "stage3_shards_the_frozen_base_and_trains_lora_as_one_process"
INIT = "frozen_parameters_built_under_init_are_sharded_from_the_start"
#: each case's worker (called with the case's own directory first), and the check of its results (one per rank)
WORKERS: dict[str, Callable[..., Any]] = {LORA: lora_worker, INIT: init_worker}
CHECKS: dict[str, Callable[..., None]] = {
    LORA: check_stage3_shards_the_frozen_base_and_trains_lora_as_one_process,
    INIT: check_frozen_parameters_built_under_init_are_sharded_from_the_start,
}
#: world 2; the LoRA run also on the GPU's path (``host_page_reuse`` false)
DEFAULT_CASES: list[Case] = [(LORA, {}), (LORA, {"host_page_reuse": False}), (INIT, {"dtype": "fp32"}),
                             (INIT, {"dtype": "bf16"})]
EXTENDED_CASES: list[Case] = [(LORA, {})]  # world 3


def labels(name: str, world: int, arguments: dict[str, Any]) -> dict[str, Any]:
    """How a case is named in failures: its check, stage 3, world size, precision and other arguments."""
    rest = dict(arguments)
    return {"check": name, "stage": 3, "world": world, "precision": rest.pop("dtype", "fp32"), **rest}


def check_cases(world: int, cases: list[Case], root: Path) -> None:
    """Run the family, load its first LoRA run's "mid" save in one process at stage 2, and check every
    case (every LoRA run's save against what that process loaded)."""
    by_rank = run_family(world, cases, WORKERS, labels=labels, root=root)
    loras = [index for index, (name, _) in enumerate(cases) if name == LORA]
    loaded = run_world(load_into_stage2, 1, args=(str(case_directory(root, loras[0])),))[0]
    check_family(cases, by_rank, CHECKS, world, labels=labels, root=root,
                 more={lora: {"loaded": loaded} for lora in loras})


def test_frozen_stage3_cases(tmp_path: Path) -> None:
    """World 2: stage 3 shards the frozen base and trains LoRA as one process (its checkpoint loaded by
    one process at stage 2; also on the GPU's path), frozen parameters built under Init are sharded from
    the start (fp32, bf16)."""
    check_cases(2, DEFAULT_CASES, tmp_path)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_frozen_stage3_extended_cases(tmp_path: Path) -> None:
    """World 3: stage 3 shards the frozen base and trains LoRA as one process (its checkpoint loaded by
    one process at stage 2)."""
    check_cases(3, EXTENDED_CASES, tmp_path)
