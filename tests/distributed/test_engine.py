"""Accumulation, communication volume, memory accounting, unused parameters and timeouts, in real worlds.

One world per world size runs every case of the training families in turn (the default cases at world
3, the extended ones at worlds 2 and 4), each case with an engine of its own, closed before the next; a
failure names the case (family, stage, world, ...).  The timeout and harness tests need worlds of their
own: a collective that timed out leaves its process group unusable, and their process groups are
created with timeouts of their own.
"""

import time
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zs_common import clone, make_model, max_rel_diff, rank_micro_batches, train_zero

import zeroshard
from zeroshard.distributed.collectives import Collectives, CollectiveError
from zeroshard.distributed.world import init_distributed
from zeroshard.planning.estimator import EstimateRequest, estimate_stage
from zeroshard.sharding.unused_params import UnusedParameterError
from zeroshard.tools.testing import CaseFailures, WorldFailed, case, run_world

WORLD_TIMEOUT_S = 600  # a world runs several families of cases, slower still on a crowded machine


def accumulation_case(rank: int, world: int, stage: int) -> float:
    base = make_model()
    a, b = clone(base), clone(base)
    # Same global batches: 4 x 1 and 1 x 4 consume identical rows per rank and step.
    first, _ = train_zero(a, rank, world, 3, micro=4, accum=1, stage=stage)
    second, _ = train_zero(b, rank, world, 3, micro=1, accum=4, stage=stage)
    diff = max_rel_diff(a, b)
    first.close()
    second.close()
    return diff


def comm_case(rank: int, world: int, stage: int, accum: int) -> dict:
    engine, _ = train_zero(make_model(), rank, world, 0, micro=1, accum=accum, stage=stage)
    engine.comm.reset_counters()
    for x, y in rank_micro_batches(0, rank, world, 1, accum):
        engine.backward(engine(x, y))
        engine.step()
    counters = {k.value: (c.calls, c.bytes_sent, c.bytes_received) for k, c in engine.comm.counters.items()}
    result = {"counters": counters, "padded": engine.storage.layout.padded_numel,
              "buckets": len(engine.storage.layout.buckets)}
    engine.close()
    return result


def memory_case(rank: int, world: int, stage: int) -> dict:
    model = make_model()
    engine, _ = train_zero(model, rank, world, 2, micro=1, accum=1, stage=stage)
    layout = engine.strategy.layout  # the trainable buckets
    held = {"after_step": engine.strategy.held_grad_bytes()}  # gradients live from backward to the step only
    x, y = next(iter(rank_micro_batches(0, rank, world, 1, 1)))
    engine.backward(engine(x, y))
    held["after_backward"] = engine.strategy.held_grad_bytes()
    engine.step()
    held["after_next_step"] = engine.strategy.held_grad_bytes()
    result = {"mb": engine.memory_breakdown(), "held": held,
              "psi": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "real_in_shard": layout.real_numel_in_shard(rank), "padded": layout.padded_numel,
              "largest_bucket": max(b.padded_numel for b in layout.buckets),
              "bucket_spans": [(b.padded_numel, *b.shard_range(rank)) for b in layout.buckets],
              "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad)}
    engine.close()
    return result


class Branchy(nn.Module):
    """``never`` is never used; ``rank0_only`` is used on rank 0 only."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 7)
        self.never = nn.Linear(7, 7)
        self.rank0_only = nn.Linear(7, 7)
        self.b = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_branch:
            h = h + self.rank0_only(h)
        return self.b(h).pow(2).mean()


def unused_case(rank: int, world: int, stage: int) -> float:
    torch.manual_seed(0)
    ref = Branchy()
    ours = clone(ref)
    ddp = DDP(ref, find_unused_parameters=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine, _, _, _ = zeroshard.initialize(model=ours, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 60}})
    for step in range(3):
        x = torch.randn(2, 7, generator=torch.Generator().manual_seed(step * 10 + rank))
        ddp(x, rank == 0).backward()
        opt.step()
        opt.zero_grad()
        engine.backward(engine(x, rank == 0))
        engine.step()
    diff = max_rel_diff(ours, ref)
    engine.close()
    return diff


def refused_unused_case(rank: int, world: int, stage: int) -> dict[str, str]:
    """``ignore_unused_parameters: false``: every rank raises, whether one rank or all left a parameter
    without a gradient; the message of each case, by case."""
    out = {}
    for where in ("one_rank", "every_rank"):
        torch.manual_seed(0)
        model = Branchy()
        model.never.requires_grad_(where == "every_rank")
        engine, _, _, _ = zeroshard.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 60, "ignore_unused_parameters": False}})
        x = torch.randn(2, 7, generator=torch.Generator().manual_seed(rank))
        try:
            engine.backward(engine(x, rank == 0 or where == "every_rank"))
            out[where] = "did not raise"
        except UnusedParameterError as err:
            assert isinstance(err, AssertionError)
            out[where] = str(err)
        engine.close()
    return out


FAMILIES: dict[str, Callable[..., Any]] = {
    "accumulation": accumulation_case, "comm": comm_case, "memory": memory_case, "unused": unused_case,
    "refused_unused": refused_unused_case,
}

Case = tuple[str, dict[str, Any]]


def key(family: str, **labels: Any) -> tuple:
    """How a case's result is found in a rank's results."""
    return (family, *sorted(labels.items()))


def engine_worker(rank: int, world: int, cases: list[Case]) -> dict:
    """Every case in turn, each named in anything it raises; the results by case."""
    out = {}
    for family, labels in cases:
        with case(family=family, world=world, **labels):
            torch.manual_seed(0)
            out[key(family, **labels)] = FAMILIES[family](rank, world, **labels)
    return out


COMM_CASES = [("comm", {"stage": stage, "accum": accum}) for accum in (1, 3) for stage in (0, 1, 2)]
#: (stage, world): the ZeRO formulas at world 3 by default, at worlds 2 and 4 in the extended run
MEMORY = [(0, 3), (1, 3), (2, 3)]
EXTENDED_MEMORY = [(1, 2), (2, 4)]


def memory_cases(world: int, memory: list[tuple[int, int]]) -> list[Case]:
    return [("memory", {"stage": stage}) for stage, w in memory if w == world]


DEFAULT_CASES: dict[int, list[Case]] = {3: COMM_CASES + memory_cases(3, MEMORY)}
EXTENDED_CASES: dict[int, list[Case]] = {
    2: [(family, {"stage": stage}) for family in ("accumulation", "unused") for stage in (0, 1, 2)]
    + [("refused_unused", {"stage": stage}) for stage in (0, 1, 2, 3)] + memory_cases(2, EXTENDED_MEMORY),
    4: memory_cases(4, EXTENDED_MEMORY),
}


def run_cases(world: int, cases: list[Case]) -> list[dict]:
    return run_world(engine_worker, world, args=(cases,), timeout=WORLD_TIMEOUT_S)


@pytest.fixture(scope="module")
def default_world_3() -> list[dict]:
    return run_cases(3, DEFAULT_CASES[3])


@pytest.fixture(scope="module")
def extended_world_2() -> list[dict]:
    return run_cases(2, EXTENDED_CASES[2])


@pytest.fixture(scope="module")
def extended_world_4() -> list[dict]:
    return run_cases(4, EXTENDED_CASES[4])


def check_per_stage(results: list[dict], family: str, world: int, bound: float) -> None:
    """Every stage's case of ``family``: its difference at most ``bound`` on every rank."""
    failures = CaseFailures()
    for stage in (0, 1, 2):
        with failures.case(stage=stage, world=world):
            assert max(r[key(family, stage=stage)] for r in results) <= bound
    failures.raise_any()


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_micro4_accum1_equals_micro1_accum4(extended_world_2) -> None:
    check_per_stage(extended_world_2, "accumulation", 2, 1e-5)


def test_communication_bytes_per_step_are_exact(default_world_3) -> None:
    n = 3
    failures = CaseFailures()
    for rank, rank_results in enumerate(default_world_3):
        for family, labels in COMM_CASES:
            stage, accum = labels["stage"], labels["accum"]
            with failures.case(stage=stage, world=n, accum=accum, rank=rank):
                result = rank_results[key(family, **labels)]
                c, padded, buckets = result["counters"], 4 * result["padded"], result["buckets"]
                one_way = (n - 1) * padded // n  # bytes of a reduce-scatter or all-gather of the padded buffer
                norm_bytes = 2 * (n - 1) * 8 // n  # one float64 all-reduce for the global grad norm
                if stage == 0:
                    assert c["all_reduce"] == (buckets, 2 * one_way, 2 * one_way)
                    assert c["reduce_scatter"][0] == c["all_gather"][0] == 0
                else:
                    reductions = accum if stage == 2 else 1  # stage 2 reduces at every micro step
                    assert c["reduce_scatter"] == (reductions * buckets, reductions * one_way, reductions * one_way)
                    assert c["all_gather"] == (buckets, one_way, one_way)
                    assert c["all_reduce"] == (1, norm_bytes, norm_bytes)
    failures.raise_any()


def check_memory(results: list[dict], stage: int, n: int) -> None:
    rank_memory = [r[key("memory", stage=stage)] for r in results]
    psi = rank_memory[0]["psi"]
    total = 0.0
    for r in rank_memory:
        mb, own = r["mb"], r["real_in_shard"]
        assert mb["params"] == 4 * psi
        assert mb["grads"] == 4 * (own if stage == 2 else psi)
        held = r["held"]
        if stage == 2:  # each bucket's chunk is kept for the run ([Note: stage 2's own chunk is reduced in place])
            assert held["after_step"] == held["after_backward"] == held["after_next_step"] == 4 * r["padded"] // n
            assert held["after_backward"] >= mb["grads"]  # padding included
            # its bucket buffers are kept from one backward to the next ([Note: when the bucket pool lets go]),
            # and of each only what lies outside the rank's own chunk of some bucket is ever written
            written = set()
            for padded, start, end in r["bucket_spans"]:
                written |= set(range(0, start)) | set(range(end, padded))
            buffers, rest = divmod(mb["comm_buffers"], 4 * len(written))
            assert buffers >= 1 and rest == 0 and len(written) < r["largest_bucket"]
        else:  # stages 0-1 keep their full-size buffer (see [Note: gradients live from backward to the step])
            assert held["after_step"] == held["after_backward"] == held["after_next_step"] == 4 * r["padded"]
        assert mb["optimizer"] == 8 * (psi if stage == 0 else own)
        assert mb["frozen_params"] == 4 * r["frozen"]
        # padding: the full buffer's (P - psi) elements where a rank holds every bucket (parameters; gradients
        # at stages 0-1; the optimizer's two fp32 tensors at stage 0), its chunks' (P/N - own) where sharded
        pad_full, pad_shard = r["padded"] - psi, r["padded"] // n - own
        assert mb["padding"] == 4 * pad_full + 4 * (pad_shard if stage == 2 else pad_full) \
            + 8 * (pad_full if stage == 0 else pad_shard)
        assert pad_full > 0 or n != 3  # 61-token vocabulary: world 3 pads
        total += mb["model_states"]
    # Summed over ranks the real holdings are exactly N times the per-rank formula.
    formula = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n}[stage]
    assert total == pytest.approx(n * formula, rel=0, abs=1e-6)
    # `zeroshard estimate` shares this accounting: its figure is the measured per-rank mean.
    assert estimate_stage(EstimateRequest(psi, n, "fp32"), stage).model_states == pytest.approx(total / n)
    assert rank_memory[0]["mb"]["formula"] == pytest.approx(formula)


def check_memory_cases(worlds: dict[int, list[dict]], memory: list[tuple[int, int]]) -> None:
    failures = CaseFailures()
    for stage, n in memory:
        with failures.case(stage=stage, world=n):
            check_memory(worlds[n], stage, n)
    failures.raise_any()


def test_memory_breakdown_matches_the_zero_formulas(default_world_3) -> None:
    check_memory_cases({3: default_world_3}, MEMORY)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_memory_breakdown_matches_the_zero_formulas_at_worlds_2_and_4(extended_world_2, extended_world_4) -> None:
    check_memory_cases({2: extended_world_2, 4: extended_world_4}, EXTENDED_MEMORY)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_unused_parameters_neither_hang_nor_get_wrong_gradients(extended_world_2) -> None:
    check_per_stage(extended_world_2, "unused", 2, 1e-6)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_ignore_unused_parameters_false_raises_on_every_rank(extended_world_2) -> None:
    for stage in (0, 1, 2, 3):
        one, every = ([r[key("refused_unused", stage=stage)][w] for r in extended_world_2]
                      for w in ("one_rank", "every_rank"))
        # rank 1 alone skipped rank0_only; both ranks raise, naming it and the key
        assert all("rank 1: rank0_only.bias, rank0_only.weight" in m and "rank 0:" not in m for m in one), (stage, one)
        assert all("ignore_unused_parameters" in m for m in one + every), (stage, one, every)
        assert all("rank 0: never.bias, never.weight; rank 1: never.bias, never.weight" in m for m in every), (stage, every)


def desync_worker(rank: int, world: int, timeout_s: float = 1800.0) -> str:
    comm = Collectives(init_distributed(timeout_s=timeout_s))
    if rank == 1:
        time.sleep(8)  # never joins the collective
        return "absent"
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4), "lonely")
    except CollectiveError as err:
        return f"{time.monotonic() - start:.1f}s {err}"
    return "no error"


def test_desynchronised_collective_fails_within_the_timeout() -> None:
    message = run_world(desync_worker, 2, pg_timeout_s=2, timeout=60)[0]
    assert "collective 'lonely' failed" in message and "collective_timeout" in message
    assert float(message.split("s ", 1)[0]) < 7


def test_collective_timeout_applies_to_a_group_created_elsewhere() -> None:
    # The harness's process group waits 60 s; zeroshard's collective_timeout of 2 s still applies.
    message = run_world(desync_worker, 2, args=(2.0,), pg_timeout_s=60, timeout=60)[0]
    assert "collective 'lonely' failed" in message
    assert float(message.split("s ", 1)[0]) < 7


def failing_worker(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()


def test_harness_reports_a_failing_rank_without_waiting_for_the_rest() -> None:
    start = time.monotonic()
    with pytest.raises(WorldFailed, match="boom on rank 1"):
        run_world(failing_worker, 2, pg_timeout_s=60, timeout=60)
    assert time.monotonic() - start < 30
