"""The collectives layer: gloo reduce-scatters and all-gathers of large buffers run in pieces (see [Note:
gloo's whole-buffer copies]), with the results and the byte counts of the whole-buffer forms."""

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
    collectives.PIECE_ELEMENTS = 128  # 8 pieces, at most 2 in flight
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
