"""Ranks whose inputs use different parts of the model train exactly like one process: every stage.

Three models whose forward depends on the data: experts chosen per token (rank 1's tokens all go to one
expert), a layer skipped for some batches (LayerDrop), a head used by one rank only, and (stage 3) a
mixture of experts marked as a ZeRO-3 leaf whose two experts are each used by one rank only.  Every
parameter is used by some rank in every step: one that no rank used gets a zero gradient here, which
AdamW still steps by its moments, where torch's optimizer skips a parameter whose gradient is None.  At stage 3
the ranks then need different units gathered, and agree on each gather
([Note: ranks agree on every gather] in sharding/stage3/gather_agreement.py); at every stage a parameter a
rank did not use contributes a zero gradient.  One world per world size loops every stage, with and
without accumulation and activation checkpointing, against one process that computes every rank's
micro batches itself (fp32, 1e-5 relative); a failure names the case (model, stage, accumulation,
checkpointing, groups, world, rank).  The world of two then ends with a rank that skips a backward.
"""

from __future__ import annotations

import itertools
from typing import Any
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zeroshard
from zeroshard.tools.testing import CaseFailures, case, run_world
from zeroshard.utils import set_z3_leaf_modules

VOCAB, WIDTH, ROWS, STEPS, LR = 16, 8, 6, 5, 1e-2


class Experts(nn.Module):
    """Each token to the expert its id chooses; only the chosen experts run (the "leaf" model marks it a
    ZeRO-3 leaf, so that its experts are gathered as one unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        route = x % len(self.experts)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            mask = route == e
            if bool(mask.any()):
                out = out + torch.where(mask[:, None], expert(h), torch.zeros_like(h))
        return torch.tanh(h + out)


class DataDependent(nn.Module):
    """``kind``: "experts", "layerdrop", "heads" or "leaf" (see the module docstring)."""

    def __init__(self, kind: str, checkpointed: bool) -> None:
        super().__init__()
        self.kind, self.checkpointed = kind, checkpointed
        self.embed = nn.Embedding(VOCAB, WIDTH)
        if kind == "leaf":
            self.moe = Experts()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.heads = nn.ModuleList(nn.Linear(WIDTH, VOCAB) for _ in range(2))

    def _run(self, block: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
        return checkpoint(block, *inputs, use_reentrant=False) if self.checkpointed else block(*inputs)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.kind == "leaf":
            h = self._run(self.moe, h, x)
        if self.kind == "experts":  # each token to the block its id chooses, skipped when none chose it
            route = x % len(self.blocks)
            out = torch.zeros_like(h)
            for e, block in enumerate(self.blocks):
                mask = route == e
                if bool(mask.any()):
                    out = out + torch.where(mask[:, None], self._run(block, h), torch.zeros_like(h))
            h = torch.tanh(h + out)
        else:
            dropped = int(x[1:].sum()) % 3 if self.kind == "layerdrop" and int(x[0]) else -1
            for i, block in enumerate(self.blocks):
                if i != dropped:
                    h = torch.tanh(self._run(block, h))
        head = self.heads[int(x[0]) % 2] if self.kind == "heads" else self.heads[0]
        return nn.functional.cross_entropy(head(h), y)


def micro_batch(step: int, micro: int, rank: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randint(0, VOCAB, (ROWS,), generator=g)
    y = torch.randint(0, VOCAB, (ROWS,), generator=g)
    if kind == "experts" and rank == 0:
        x[:4] = torch.arange(4)  # rank 0 uses every expert
    if kind == "experts" and rank == 1:
        x = x // 4 * 4 + 1  # every token of rank 1 to expert 1
    if kind == "leaf":
        x = x // 2 * 2 + rank % 2  # even ranks' tokens all to expert 0, odd ranks' to expert 1
    if kind in ("heads", "layerdrop"):
        x[0] = rank  # heads: rank 0 uses head 0 only, rank 1 head 1 only; layerdrop: rank 0 drops none
    return x, y


def reference(kind: str, checkpointed: bool, world: int, accum: int) -> dict[str, torch.Tensor]:
    """One process: every rank's micro batches, the loss averaged over ranks and micro steps."""
    torch.manual_seed(0)
    model = DataDependent(kind, checkpointed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for step in range(STEPS):
        for micro in range(accum):
            loss = sum(model(*micro_batch(step, micro, r, kind)) for r in range(world))
            (loss / (world * accum)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trained(rank: int, kind: str, checkpointed: bool, stage: int, accum: int,
            **zero: Any) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = DataDependent(kind, checkpointed)
    if kind == "leaf":
        set_z3_leaf_modules(model, [Experts])
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": accum,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 100,
                              **zero},
        "collective_timeout": 60})
    if kind == "leaf" and stage == 3:  # the leaf is one unit; its experts have none of their own
        units = [unit.name for unit in engine.strategy.plan.units]
        assert "moe" in units and not any(u.startswith("moe.") for u in units), units
    for step in range(STEPS):
        for micro in range(accum):
            engine.backward(engine(*micro_batch(step, micro, rank, kind)))
            engine.step()
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    return state


#: (model, stage, accumulation, checkpointed, zero_optimization keys)
Case = tuple[str, int, int, bool, dict[str, Any]]
CASES: list[Case] = [(kind, stage, accum, checkpointed, {}) for kind, stage, accum, checkpointed
                     in itertools.product(("experts", "layerdrop", "heads"), (0, 1, 2, 3), (1, 2), (False, True))]
#: a mixture of experts marked as a ZeRO-3 leaf (see [Note: leaf modules] in sharding/stage3/units.py)
CASES += [("leaf", 3, accum, checkpointed, {}) for accum, checkpointed in ((1, False), (2, True))]
#: stage 3 with the hybrid groups and offload, where the gather rounds span groups of their own
HYBRID = ({"mics_shard_size": 2}, {"zero_hpz_partition_size": 2},
          {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}})
HYBRID_CASES: list[Case] = [(kind, 3, 2, checkpointed, zero)
                            for zero in HYBRID for kind, checkpointed in (("experts", False), ("layerdrop", True))]


def labels(world: int, kind: str, stage: int, accum: int, checkpointed: bool, zero: dict[str, Any]) -> dict[str, Any]:
    """How a case is named in failures."""
    return {"model": kind, "stage": stage, "world": world, "precision": "fp32", "accumulation": accum,
            "checkpointed": checkpointed, "zero": zero}


def off_by(rank: int, world: int, kind: str, stage: int, accum: int, checkpointed: bool, zero: dict[str, Any]) -> float:
    """The largest relative difference between training here and the reference (one process)."""
    ours = trained(rank, kind, checkpointed, stage, accum, **zero)
    expected = reference(kind, checkpointed, world, accum)
    return max(float((ours[k] - v).abs().max()) / (float(v.abs().max()) or 1.0) for k, v in expected.items())


def world_worker(rank: int, world: int, cases: list[Case], skip_a_backward: bool) -> dict[str, Any]:
    """Every case in this one world; then, with ``skip_a_backward``, a rank that skips a backward (last:
    it leaves an engine that cannot go on)."""
    out: dict[str, Any] = {"off_by": []}
    for kind, stage, accum, checkpointed, zero in cases:
        with case(**labels(world, kind, stage, accum, checkpointed, zero)):
            out["off_by"].append(off_by(rank, world, kind, stage, accum, checkpointed, zero))
    if skip_a_backward:
        with case(check="a_rank_that_skips_a_backward_gets_a_divergence_error", stage=3, world=world):
            out["skipped_backward"] = skipped_backward_worker(rank, world)
    return out


def check_every_case(by_rank: list[dict[str, Any]], world: int, cases: list[Case],
                     failures: CaseFailures) -> None:
    for rank, result in enumerate(by_rank):
        assert len(result["off_by"]) == len(cases), f"rank {rank} ran {len(result['off_by'])} of {len(cases)} cases"
        for (kind, stage, accum, checkpointed, zero), worst in zip(cases, result["off_by"]):
            with failures.case(**labels(world, kind, stage, accum, checkpointed, zero), rank=rank):
                assert worst <= 1e-5, f"off by {worst:.2e}"


def skipped_backward_worker(rank: int, world: int) -> str:
    torch.manual_seed(0)
    engine, _, _, _ = zeroshard.initialize(model=DataDependent("experts", False), config={
        "train_micro_batch_size_per_gpu": ROWS, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "collective_timeout": 60})
    loss = engine(*micro_batch(0, 0, rank, "experts"))
    try:
        if rank == 0:
            engine.backward(loss)
        engine.step()
    except zeroshard.CollectiveError as error:
        return type(error).__name__
    return "no error"


@pytest.mark.parametrize("world", [2])
def test_ranks_using_different_modules_train_like_one_process(world: int) -> None:
    """Every case at this world size; at world 2 then a rank that skips a backward gets a divergence
    error (both ranks)."""
    skip_a_backward = world == 2
    by_rank = run_world(world_worker, world, args=(CASES, skip_a_backward), timeout=600)
    failures = CaseFailures()
    check_every_case(by_rank, world, CASES, failures)
    if skip_a_backward:
        with failures.case(check="a_rank_that_skips_a_backward_gets_a_divergence_error", stage=3, world=world):
            assert [r["skipped_backward"] for r in by_rank] == ["DivergenceError", "DivergenceError"]
    failures.raise_any()


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_ranks_using_different_modules_with_hybrid_groups_and_offload_train_like_one_process() -> None:
    by_rank = run_world(world_worker, 4, args=(HYBRID_CASES, False), timeout=600)
    failures = CaseFailures()
    check_every_case(by_rank, 4, HYBRID_CASES, failures)
    failures.raise_any()
