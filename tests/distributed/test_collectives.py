"""The collectives layer: gloo reduce-scatters and all-gathers run as rings of messages (see [Note: gloo's
collectives as rings] in distributed/ring.py), received in pieces, with the results and byte counts of
the whole collectives.

One world per world size runs every case of that size in turn (worlds 2 and 3 by default, 1 and 4 in
the extended run); each case puts back the piece size it set, and a failure names the case (family and
world).  The tests read their cases' results from these worlds.
"""

import resource
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest
import torch

import zeroshard.distributed.collectives as collectives
from zeroshard.distributed.collectives import Collectives
from zeroshard.distributed.world import init_distributed
from zeroshard.tools.testing import case, run_world

DEFAULT_PIECE_BYTES = collectives.PIECE_BYTES
LINUX = sys.platform.startswith("linux")
WORLD_TIMEOUT_S = 600  # a world runs several families of cases, slower still on a crowded machine


def pieces_case(rank: int, world: int) -> dict:
    comm = Collectives(init_distributed())
    g = torch.Generator().manual_seed(rank)
    chunk = 1000
    full = torch.randn(world * chunk, generator=g)
    whole_rs, whole_ag = torch.empty(chunk), torch.empty(world * chunk)
    comm.reduce_scatter(whole_rs, full.clone(), "whole")
    comm.all_gather(whole_ag, full[rank * chunk:(rank + 1) * chunk].clone(), "whole")
    before = comm.total_bytes_sent()
    collectives.PIECE_BYTES = 128 * 4  # pieces of 128 fp32 elements: 8 a chunk, two received at once
    pieced_rs, pieced_ag = torch.empty(chunk), torch.empty(world * chunk)
    comm.reduce_scatter(pieced_rs, full.clone(), "pieces", async_op=True).wait()
    comm.all_gather(pieced_ag, full[rank * chunk:(rank + 1) * chunk].clone(), "pieces")
    return {"rs": torch.equal(whole_rs, pieced_rs), "rs_close": torch.allclose(whole_rs, pieced_rs, atol=1e-6),
            "ag": torch.equal(whole_ag, pieced_ag), "bytes": (before, comm.total_bytes_sent() - before),
            "calls": comm.counters[collectives.CommKind.REDUCE_SCATTER].calls}


def test_gloo_collectives_in_pieces_give_the_same_results_and_bytes(world_3) -> None:
    for r in results_of(world_3, "pieces"):
        assert r["rs_close"] and r["ag"]
        assert r["bytes"][0] == r["bytes"][1]  # counted as the one collective it is
        assert r["calls"] == 2


def everyones(world: int, chunk: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's input (small integers: their sums are exact in any dtype and any order)."""
    return [torch.randint(-8, 8, (world * chunk,), generator=torch.Generator().manual_seed(seed * 100 + r)).to(dtype)
            for r in range(world)]


def rings_case(rank: int, world: int) -> list:
    """Several ring collectives in flight at once, waited for in another order, ragged pieces."""
    collectives.PIECE_BYTES = 5 * 8  # 5 float64 elements a piece (10 fp32, 20 bf16): ragged pieces of a 23-element chunk
    comm = Collectives(init_distributed())
    chunk, checks, pending = 23, [], []
    for seed, dtype in enumerate([torch.float64, torch.bfloat16, torch.float32]):
        inputs = everyones(world, chunk, dtype, seed)
        expected = torch.stack(inputs).sum(0)
        full, out = inputs[rank].clone(), torch.empty(chunk, dtype=dtype)
        pending.append((comm.reduce_scatter(out, full, f"rs{seed}", async_op=True), out,
                        expected[rank * chunk:(rank + 1) * chunk]))
        gathered = torch.zeros(world * chunk, dtype=dtype)
        shard = inputs[rank][rank * chunk:(rank + 1) * chunk].clone()  # a separate tensor
        pending.append((comm.all_gather(gathered, shard, f"ag{seed}", async_op=True), gathered,
                        torch.cat([inputs[r][r * chunk:(r + 1) * chunk] for r in range(world)])))
        in_place = inputs[rank].clone()  # the shard is the output's own chunk, as stage 3 gathers
        pending.append((comm.all_gather(in_place, in_place[rank * chunk:(rank + 1) * chunk], f"agi{seed}",
                                        async_op=True), in_place, pending[-1][2]))
    for work, got, want in reversed(pending):
        work.wait()
        checks.append(torch.equal(got, want))
    return checks


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_collectives_in_flight_together_give_exact_results(world: int, request) -> None:
    """gloo's reduce-scatters and all-gathers are zeroshard's rings of messages ([Note: gloo's collectives
    as rings] in ring.py): nine of them in flight at once between the same ranks, each of its own
    dtype and pieces, waited for newest first, each gives exactly what the whole sum or gather is."""
    for checks in results_of(request.getfixturevalue(f"world_{world}"), "rings"):
        assert checks == [True] * 9


def own_input_case(rank: int, world: int) -> dict:
    comm = Collectives(init_distributed())
    collectives.PIECE_BYTES = 128 * 4  # several pieces a chunk
    chunk = 1000
    full = torch.randn(world * chunk, generator=torch.Generator().manual_seed(rank))
    own = slice(rank * chunk, (rank + 1) * chunk)
    expected = torch.empty(chunk)
    comm.reduce_scatter(expected, full.clone(), "whole")
    earlier = torch.randn(chunk, generator=torch.Generator().manual_seed(100 + rank))
    summed = earlier + full[own]  # an earlier sum with this rank's own chunk added, as stage 2 keeps it
    scratch = full.clone()
    scratch[own] = float("nan")  # never read, never written
    comm.reduce_scatter(summed, scratch, "in_place", async_op=True, own_input=summed).wait()
    return {"close": torch.allclose(summed, earlier + expected, atol=1e-5),
            "own_untouched": bool(scratch[own].isnan().all())}


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2, 3])
def test_reduce_scatter_with_the_own_chunk_outside_the_buffer_sums_in_place(world: int, request) -> None:
    """``own_input``: this rank's chunk of the input lives in the output (stage 2's kept chunk, see
    [Note: stage 2's own chunk is reduced in place]): the sum accumulates there, and the buffer's own
    chunk is neither read nor written."""
    for r in results_of(request.getfixturevalue(f"world_{world}"), "own_input"):
        assert r["close"]
        assert r["own_untouched"] or world == 1


def faults_case(rank: int, world: int) -> list:
    collectives.PIECE_BYTES = DEFAULT_PIECE_BYTES
    comm = Collectives(init_distributed())
    chunk = 9_000_000  # per rank (36 MB): room for a reduce-scatter's temporaries of 32 MiB, were they so large
    full, out = torch.zeros(world * chunk), torch.empty(chunk)
    faults = []
    for _ in range(8):  # a gather and a reduce-scatter, as in training
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        comm.all_gather(full, full[rank * chunk:(rank + 1) * chunk], "gather")
        comm.reduce_scatter(out, full, "reduce")
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults


@pytest.mark.skipif(not LINUX, reason="glibc's allocator and getrusage page faults")
def test_large_gloo_collectives_reuse_the_heap_instead_of_faulting_in_fresh_pages(world_2) -> None:
    """Large gloo collectives do not map fresh memory at every call (see [Note: gloo's whole-buffer
    copies]): once warm, a gather of 36 MB per rank (received in place by the ring) and a reduce-scatter
    (received into two temporaries under glibc's largest mmap threshold) fault in no 32 MiB of pages,
    and the last six pairs together at most three such calls' worth.  With temporaries of 32 MiB
    (``PIECE_BYTES`` of 32 MiB) a pair faults more than that (measured: 8,791 pages)."""
    for faults in results_of(world_2, "faults"):
        assert max(faults[-6:]) < 8192 and sum(faults[-6:]) < 3 * 8192, faults


def other_kind_case(rank: int, world: int) -> list:
    comm = Collectives(init_distributed())
    wider = torch.arange(6, dtype=torch.float64) + 10 * rank  # float64 into a float32 output
    strided = (torch.arange(12.0) + 100 * rank)[::2]  # a view that is not contiguous
    out = []
    for shard in (wider, strided):
        full = torch.zeros(world * 6)
        comm.all_gather(full, shard, "other_kind")
        out.append(full.tolist())
    return out


def test_ring_all_gather_takes_a_shard_of_another_dtype_or_layout(world_3) -> None:
    """The ring's all-gather sends its first step from the shard itself; a shard of another dtype, or
    not contiguous, is first copied into the output's own chunk (as gloo's collective did), so every
    rank gets every shard's values in the output's dtype."""
    for got in results_of(world_3, "other_kind"):
        assert got[0] == [float(i + 10 * r) for r in range(3) for i in range(6)]
        assert got[1] == [float(2 * i + 100 * r) for r in range(3) for i in range(6)]


def progress_case(rank: int, world: int) -> dict:
    comm = Collectives(init_distributed())
    chunk = 6 * collectives.PIECE_BYTES // 4  # six pieces a chunk: more than a reduce-scatter receives at once
    inputs = everyones(world, chunk, torch.float32, seed=7)
    full, out = inputs[rank].clone(), torch.empty(chunk)
    gathered = torch.zeros(world * chunk)
    reduce = comm.reduce_scatter(out, full, "unwaited_rs", async_op=True)
    gather = comm.all_gather(gathered, inputs[rank][rank * chunk:(rank + 1) * chunk].clone(), "unwaited_ag",
                             async_op=True)
    polls = 0
    while not (reduce.is_completed() and gather.is_completed()) and polls < 6000:  # 60 s: a hang, not a speed
        time.sleep(0.01)
        polls += 1
    finished_unwaited = reduce.is_completed() and gather.is_completed()
    reduce.wait()
    gather.wait()
    return {"finished_unwaited": finished_unwaited,
            "rs": torch.equal(out, torch.stack(inputs).sum(0)[rank * chunk:(rank + 1) * chunk]),
            "ag": torch.equal(gathered, torch.cat([inputs[r][r * chunk:(r + 1) * chunk] for r in range(world)]))}


@pytest.mark.parametrize("world", [2, 3])
def test_rings_finish_while_the_training_thread_does_not_wait(world: int, request) -> None:
    """A launched ring is carried to its end by the progress thread ([Note: rings progress on their own
    thread] in ring_progress.py), not in ``wait()``: a reduce-scatter of six pieces a chunk and an
    all-gather that must pass pieces on (world 3) both finish while the training thread only sleeps,
    with exact results.  Driven from ``wait()``, the reduce-scatter stopped after its first two pieces."""
    for r in results_of(request.getfixturevalue(f"world_{world}"), "progress"):
        assert r == {"finished_unwaited": True, "rs": True, "ag": True}


def two_groups_case(rank: int, world: int) -> dict:
    import dataclasses

    import torch.distributed as dist

    base = init_distributed()
    other = Collectives(dataclasses.replace(base, group=dist.new_group(backend="gloo")))
    comm = Collectives(base)
    chunk = 6 * collectives.PIECE_BYTES // 4  # six pieces: a reduce-scatter receives two at a time
    inputs = everyones(world, chunk, torch.float32, seed=3)
    outs = {name: torch.empty(chunk) for name in ("main", "other")}
    launch = [(comm, "main"), (other, "other")]
    if rank % 2:  # the other order: as an asynchronous save's thread and the training thread may
        launch.reverse()
    pending = [c.reduce_scatter(outs[name], inputs[rank].clone(), name, async_op=True) for c, name in launch]
    polls = 0
    while not all(p.is_completed() for p in pending) and polls < 3000:  # 30 s: a deadlock, not a speed
        time.sleep(0.01)
        polls += 1
    done = all(p.is_completed() for p in pending)
    if not done:
        return {"done": False}
    for p in pending:
        p.wait()
    expected = torch.stack(inputs).sum(0)[rank * chunk:(rank + 1) * chunk]
    return {"done": True, "exact": all(torch.equal(out, expected) for out in outs.values())}


def test_rings_of_two_groups_launched_in_different_orders_both_finish(world_2) -> None:
    """Each process group's rings progress on a thread of their own: rank 0 launches a reduce-scatter
    on the default group and then one on another group, rank 1 the other way round (as an asynchronous
    save's group and training's may), and both finish, exactly.  With one queue for every group, each
    rank's thread waited on the ring its neighbour had queued second: a deadlock (checked)."""
    for r in results_of(world_2, "two_groups"):
        assert r == {"done": True, "exact": True}


FAMILIES: dict[str, Callable[..., Any]] = {
    "pieces": pieces_case, "rings": rings_case, "own_input": own_input_case, "faults": faults_case,
    "other_kind": other_kind_case, "progress": progress_case, "two_groups": two_groups_case,
}
#: the cases of each world size, in the order they run: two groups last, as it leaves a group behind
#: (and, were it to deadlock, rings in flight)
CASES: dict[int, list[str]] = {
    1: ["own_input"],
    2: ["rings", "own_input", "progress", *(["faults"] if LINUX else []), "two_groups"],
    3: ["pieces", "rings", "own_input", "other_kind", "progress"],
    4: ["rings"],
}


@contextmanager
def piece_size_put_back() -> Iterator[None]:
    """A case may set ``collectives.PIECE_BYTES``; the next one starts from the default."""
    try:
        yield
    finally:
        collectives.PIECE_BYTES = DEFAULT_PIECE_BYTES


def collectives_worker(rank: int, world: int, families: list[str]) -> dict[str, Any]:
    """Every case in turn, each named in anything it raises; the results by family."""
    out = {}
    for family in families:
        with case(family=family, world=world), piece_size_put_back():
            out[family] = FAMILIES[family](rank, world)
    return out


def results_of(world_results: list[dict[str, Any]], family: str) -> list[Any]:
    """One family's results, by rank."""
    return [rank_results[family] for rank_results in world_results]


def run_cases(world: int) -> list[dict[str, Any]]:
    return run_world(collectives_worker, world, args=(CASES[world],), timeout=WORLD_TIMEOUT_S)


@pytest.fixture(scope="module")
def world_1() -> list[dict[str, Any]]:
    return run_cases(1)


@pytest.fixture(scope="module")
def world_2() -> list[dict[str, Any]]:
    return run_cases(2)


@pytest.fixture(scope="module")
def world_3() -> list[dict[str, Any]]:
    return run_cases(3)


@pytest.fixture(scope="module")
def world_4() -> list[dict[str, Any]]:
    return run_cases(4)
