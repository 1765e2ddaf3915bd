"""Stages 0-3 against DistributedDataParallel + torch.optim.AdamW, at world sizes 1-4.

The model has a tied embedding, a frozen layer and a vocabulary (61) that no world size divides;
clipping is active (the gradient norm is far above 0.05) and the buckets are small, so every run uses
several buckets with padding.  fp32: parameters must agree to max relative difference 1e-5, and a
steady-state optimizer step reads one device value on the host, whatever the stage.  One world
per world size runs every stage and variant in turn; a failure names stage, variant, world and batch.
"""

import pytest
import zeroshard
from zs_common import clone, host_reads, make_model, max_rel_diff, rank_micro_batches, train_ddp, train_zero

from zeroshard.tools.testing import CaseFailures, case, run_world

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
#: top-level config keys of a variant: at world 1, every collective issued over the one rank, as a
#: one-GPU check of the communication path does
TOP_LEVEL_VARIANTS = {"at_one": {"collectives_in_a_world_of_one": True}}
#: (stage, variant) run at every world size; the communication variants run at world 3 (extended)
DEFAULT_CASES = [(0, ""), (1, ""), (2, ""), (3, "prefetch"), (3, "no_prefetch")]
AT_ONE_CASES = [(0, "at_one"), (1, "at_one"), (2, "at_one"), (3, "at_one")]
VARIANT_CASES = [(stage, variant) for stage in (1, 2, 3) for variant in sorted(VARIANTS)]


def parity_worker(rank: int, world: int, cases: list[tuple[int, str]]) -> dict:
    out = {}
    for stage, variant in cases:
        for micro, accum in ((2, 1), (1, 3)):
            with case(stage=stage, variant=variant or "default", world=world, micro=micro, accum=accum):
                ref = make_model()
                ours = clone(ref)
                ref_norms = train_ddp(ref, rank, world, STEPS, micro, accum)
                engine, norms = train_zero(ours, rank, world, STEPS, micro, accum, stage,
                                           top=TOP_LEVEL_VARIANTS.get(variant),
                                           **{**STAGE3_VARIANTS, **VARIANTS}.get(variant, {}))
                issued = sum(c.seconds for c in engine.comm.counters.values())  # time only launches take
                with zeroshard.GatheredParameters(list(ours.parameters())):
                    diff = max_rel_diff(ours, ref)
                with host_reads() as reads:  # one more step, after the comparison
                    for x, y in rank_micro_batches(STEPS, rank, world, micro, accum):
                        engine.backward(engine(x, y))
                        engine.step()
                engine.close()
                out[(stage, variant, micro, accum)] = (diff, ref_norms, norms, dict(reads), issued)
    return out


def check(results: list[dict], world: int, cases: list[tuple[int, str]]) -> None:
    failures = CaseFailures()
    for rank, rank_result in enumerate(results):
        assert len(rank_result) == 2 * len(cases), f"rank {rank} ran {len(rank_result)} of {2 * len(cases)} cases"
        for (stage, variant, micro, accum), (diff, ref_norms, norms, reads, issued) in sorted(rank_result.items()):
            with failures.case(stage=stage, variant=variant or "default", world=world, rank=rank, micro=micro,
                               accum=accum):
                assert diff <= 1e-5, f"max relative difference {diff:.2e}"
                assert all(n > 0.05 for n in ref_norms), "clipping must be active in this test"
                for ours, theirs in zip(norms, ref_norms):
                    assert ours == pytest.approx(theirs, rel=1e-5)
                # a steady-state optimizer step of `accum` micro steps reads one device value on the
                # host (see [Note: one host read per optimizer step] in zeroshard/engine/optimizer_step.py)
                assert reads == {"engine/optimizer_step.py:run": 1}, f"host reads in one step: {reads}"
                # a world of one issues nothing, unless told to issue what a larger world would
                assert (issued > 0) == (world > 1 or variant == "at_one"), f"{issued:.2e} s in collectives"
    failures.raise_any()


@pytest.mark.parametrize("world", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])  # world 4: extended (CI)
def test_every_stage_matches_ddp_adamw(world: int) -> None:
    cases = DEFAULT_CASES + (AT_ONE_CASES if world == 1 else [])
    check(run_world(parity_worker, world, args=(cases,), timeout=600), world, cases)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_communication_variants_match_ddp() -> None:
    check(run_world(parity_worker, 3, args=(VARIANT_CASES,), timeout=600), 3, VARIANT_CASES)
