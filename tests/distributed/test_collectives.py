"""The collectives layer: gloo reduce-scatters and all-gathers of large buffers run in pieces (see [Note:
gloo's whole-buffer copies]), with the results and the byte counts of the whole-buffer forms."""

import resource
import sys

import pytest
import torch

import zeroshard.distributed.collectives as collectives
from zeroshard.distributed.collectives import Collectives
from zeroshard.distributed.world import init_distributed
from zeroshard.testing import run_world


def pieces_worker(rank: int, world: int) -> dict:
    comm = Collectives(init_distributed())
    g = torch.Generator().manual_seed(rank)
    chunk = 1000
    full = torch.randn(world * chunk, generator=g)
    whole_rs, whole_ag = torch.empty(chunk), torch.empty(world * chunk)
    comm.reduce_scatter(whole_rs, full.clone(), "whole")
    comm.all_gather(whole_ag, full[rank * chunk:(rank + 1) * chunk].clone(), "whole")
    before = comm.total_bytes_sent()
    collectives.PIECE_BYTES = 128 * world * 4  # 128 fp32 elements per rank: 8 pieces, at most 2 in flight
    pieced_rs, pieced_ag = torch.empty(chunk), torch.empty(world * chunk)
    comm.reduce_scatter(pieced_rs, full.clone(), "pieces", async_op=True).wait()
    comm.all_gather(pieced_ag, full[rank * chunk:(rank + 1) * chunk].clone(), "pieces")
    return {"rs": torch.equal(whole_rs, pieced_rs), "rs_close": torch.allclose(whole_rs, pieced_rs, atol=1e-6),
            "ag": torch.equal(whole_ag, pieced_ag), "bytes": (before, comm.total_bytes_sent() - before),
            "calls": comm.counters[collectives.CommKind.REDUCE_SCATTER].calls}


def test_gloo_collectives_in_pieces_give_the_same_results_and_bytes() -> None:
    for r in run_world(pieces_worker, 3):
        assert r["rs_close"] and r["ag"]
        assert r["bytes"][0] == r["bytes"][1]  # counted as the one collective it is
        assert r["calls"] == 2


def faults_worker(rank: int, world: int, piece_bytes: int) -> list:
    collectives.PIECE_BYTES = piece_bytes
    comm = Collectives(init_distributed())
    chunk = 5_700_000  # per rank: a bucket of DeepSpeed's default size capped at 1/8 of a 91M model
    full, out = torch.zeros(world * chunk), torch.empty(chunk)
    faults = []
    for _ in range(8):  # the gathers, between reduce-scatters as in training
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        comm.all_gather(full, full[rank * chunk:(rank + 1) * chunk], "gather")
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        comm.reduce_scatter(out, full, "reduce")
    return faults


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and getrusage page faults")
def test_large_gloo_collectives_reuse_the_heap_instead_of_faulting_in_fresh_pages() -> None:
    """gloo's temporary for a piece stays under glibc's largest mmap threshold (see [Note: gloo's
    whole-buffer copies]): once the first calls have raised the threshold, a gather of 23 MB per rank
    reuses the heap; with 32 MiB temporaries every call faults in a whole piece's pages again (8,194).
    Now and then a warm call still faults one 16 MiB temporary's pages (~4,100: glibc trims the heap's
    top), so the bounds are: no warm call faults 32 MiB, and the last six together fault at most three
    of the old calls' pages (the old size: six)."""
    for faults in run_world(faults_worker, 2, args=(collectives.PIECE_BYTES,)):
        assert max(faults[-6:]) < 8192 and sum(faults[-6:]) < 3 * 8192, faults
