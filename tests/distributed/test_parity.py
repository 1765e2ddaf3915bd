"""Stages 0-2 against DistributedDataParallel + torch.optim.AdamW, at world sizes 1-4.

The model has a tied embedding, a frozen layer and a vocabulary (61) that no world size divides;
clipping is active (the gradient norm is far above 0.05) and the buckets are small, so every run uses
several buckets with padding.  fp32: parameters must agree to max relative difference 1e-5.
"""

import pytest
from zs_common import clone, make_model, max_rel_diff, train_ddp, train_zero

from zeroshard.testing import run_world

STEPS = 5


def parity_worker(rank: int, world: int, stage: int) -> list[tuple]:
    out = []
    for micro, accum in ((2, 1), (1, 3)):
        ref = make_model()
        ours = clone(ref)
        ref_norms = train_ddp(ref, rank, world, STEPS, micro, accum)
        engine, norms = train_zero(ours, rank, world, STEPS, micro, accum, stage)
        out.append((micro, accum, max_rel_diff(ours, ref), ref_norms, norms))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_matches_ddp_adamw(stage: int, world: int) -> None:
    for rank_result in run_world(parity_worker, world, args=(stage,)):
        for micro, accum, diff, ref_norms, norms in rank_result:
            assert diff <= 1e-5, f"stage {stage} world {world} micro {micro} accum {accum}: {diff:.2e}"
            assert all(n > 0.05 for n in ref_norms), "clipping must be active in this test"
            for ours, theirs in zip(norms, ref_norms):
                assert ours == pytest.approx(theirs, rel=1e-5)
