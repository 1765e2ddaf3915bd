"""Stages 0-2 against DistributedDataParallel + torch.optim.AdamW, at world sizes 1-4.

The model has a tied embedding, a frozen layer and a vocabulary (61) that no world size divides;
clipping is active (the gradient norm is far above 0.05) and the buckets are small, so every run uses
several buckets with padding.  fp32: parameters must agree to max relative difference 1e-5.
"""

import pytest
import zeroshard
from zs_common import clone, make_model, max_rel_diff, train_ddp, train_zero

from zeroshard.tools.testing import run_world

STEPS = 5


# Stage 3: matrices sharded, vectors of 16 elements persistent; prefetch on, with units kept for reuse
# (DeepSpeed's defaults), and off, with every unit released after each use.
VARIANTS = {
    "all_reduce": {"reduce_scatter": False},  # stages 1-3 may all-reduce and keep their chunk
    "blocking": {"overlap_comm": False},
}
STAGE3_VARIANTS = {
    "prefetch": {"stage3_param_persistence_threshold": 20},
    "no_prefetch": {"stage3_param_persistence_threshold": 20, "stage3_prefetch_bucket_size": 0,
                    "stage3_max_reuse_distance": 0},
}


def parity_worker(rank: int, world: int, stage: int, variant: str = "") -> list[tuple]:
    out = []
    for micro, accum in ((2, 1), (1, 3)):
        ref = make_model()
        ours = clone(ref)
        ref_norms = train_ddp(ref, rank, world, STEPS, micro, accum)
        engine, norms = train_zero(ours, rank, world, STEPS, micro, accum, stage, **{**STAGE3_VARIANTS, **VARIANTS}.get(variant, {}))
        with zeroshard.GatheredParameters(list(ours.parameters())):
            diff = max_rel_diff(ours, ref)
        out.append((micro, accum, diff, ref_norms, norms))
    return out


def check(results: list, stage: int, world: int) -> None:
    for rank_result in results:
        for micro, accum, diff, ref_norms, norms in rank_result:
            assert diff <= 1e-5, f"stage {stage} world {world} micro {micro} accum {accum}: {diff:.2e}"
            assert all(n > 0.05 for n in ref_norms), "clipping must be active in this test"
            for ours, theirs in zip(norms, ref_norms):
                assert ours == pytest.approx(theirs, rel=1e-5)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_matches_ddp_adamw(stage: int, world: int) -> None:
    check(run_world(parity_worker, world, args=(stage,)), stage, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("variant", sorted(STAGE3_VARIANTS))
def test_stage3_matches_ddp_adamw(variant: str, world: int) -> None:
    check(run_world(parity_worker, world, args=(3, variant)), 3, world)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_communication_variants_match_ddp(stage: int, variant: str) -> None:
    check(run_world(parity_worker, 3, args=(stage, variant)), stage, 3)
