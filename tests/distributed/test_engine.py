"""Accumulation, communication volume, memory accounting, unused parameters and timeouts, in real worlds."""

import time

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
from zeroshard.tools.testing import WorldFailed, run_world


def accumulation_worker(rank: int, world: int, stage: int) -> float:
    base = make_model()
    a, b = clone(base), clone(base)
    # Same global batches: 4 x 1 and 1 x 4 consume identical rows per rank and step.
    train_zero(a, rank, world, 3, micro=4, accum=1, stage=stage)
    train_zero(b, rank, world, 3, micro=1, accum=4, stage=stage)
    return max_rel_diff(a, b)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_micro4_accum1_equals_micro1_accum4(stage: int) -> None:
    assert max(run_world(accumulation_worker, 2, args=(stage,))) <= 1e-5


def comm_worker(rank: int, world: int, stage: int, accum: int) -> dict:
    engine, _ = train_zero(make_model(), rank, world, 0, micro=1, accum=accum, stage=stage)
    engine.comm.reset_counters()
    from zs_common import rank_micro_batches
    for x, y in rank_micro_batches(0, rank, world, 1, accum):
        engine.backward(engine(x, y))
        engine.step()
    counters = {k.value: (c.calls, c.bytes_sent, c.bytes_received) for k, c in engine.comm.counters.items()}
    return {"counters": counters, "padded": engine.flat.layout.padded_numel,
            "buckets": len(engine.flat.layout.buckets)}


@pytest.mark.parametrize("stage, accum", [(0, 1), (1, 1), (2, 1), (0, 3), (1, 3), (2, 3)])
def test_communication_bytes_per_step_are_exact(stage: int, accum: int) -> None:
    n = 3
    for result in run_world(comm_worker, n, args=(stage, accum)):
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


def memory_worker(rank: int, world: int, stage: int) -> dict:
    model = make_model()
    engine, _ = train_zero(model, rank, world, 2, micro=1, accum=1, stage=stage)
    layout = engine.strategy.layout  # the trainable buckets
    held = {"after_step": engine.strategy.held_grad_bytes()}  # gradients live from backward to the step only
    x, y = next(iter(rank_micro_batches(0, rank, world, 1, 1)))
    engine.backward(engine(x, y))
    held["after_backward"] = engine.strategy.held_grad_bytes()
    engine.step()
    held["after_next_step"] = engine.strategy.held_grad_bytes()
    return {"mb": engine.memory_breakdown(), "held": held, "psi": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "real_in_shard": layout.real_numel_in_shard(rank), "padded": layout.padded_numel,
            "largest_bucket": max(b.padded_numel for b in layout.buckets),
            "bucket_spans": [(b.padded_numel, *b.shard_range(rank)) for b in layout.buckets],
            "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad)}


@pytest.mark.parametrize("stage, n", [(0, 3), (1, 3), (2, 3), (1, 2), (2, 4)])
def test_memory_breakdown_matches_the_zero_formulas(stage: int, n: int) -> None:
    results = run_world(memory_worker, n, args=(stage,))
    psi = results[0]["psi"]
    total = 0.0
    for r in results:
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
        assert mb["padding"] > 0 if n == 3 else mb["padding"] >= 0  # 61-token vocabulary: world 3 pads
        total += mb["model_states"]
    # Summed over ranks the real holdings are exactly N times the per-rank formula.
    formula = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n}[stage]
    assert total == pytest.approx(n * formula, rel=0, abs=1e-6)
    # `zeroshard estimate` shares this accounting: its figure is the measured per-rank mean.
    assert estimate_stage(EstimateRequest(psi, n, "fp32"), stage).model_states == pytest.approx(total / n)
    assert results[0]["mb"]["formula"] == pytest.approx(formula)


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


def unused_worker(rank: int, world: int, stage: int) -> float:
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
    return max_rel_diff(ours, ref)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_unused_parameters_neither_hang_nor_get_wrong_gradients(stage: int) -> None:
    assert max(run_world(unused_worker, 2, args=(stage,), timeout=120)) <= 1e-6


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
