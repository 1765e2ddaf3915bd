"""A NaN loss on one rank, in fp32 or bf16: every rank skips that step exactly as if it had not happened,
the rank is named, and NaNs that keep coming stop training with an error naming rank and parameter."""

import pytest
import torch

import zeroshard
from zeroshard.tools.testing import CaseFailures, case, run_world

from zs_common import make_model, rank_micro_batches, zero_config


def build(stage: int, precision: str, max_skips: int = 10):
    torch.manual_seed(0)
    config = zero_config(stage, 2, 1, stage3_param_persistence_threshold=0)
    config["max_consecutive_skips"] = max_skips
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = zeroshard.initialize(model=make_model(), config=config)
    return engine


def train(rank: int, world: int, stage: int, precision: str, poison: set, steps: int, max_skips: int = 10):
    engine = build(stage, precision, max_skips)
    for step in range(steps):
        for x, y in rank_micro_batches(step, rank, world, 2, 1):
            loss = engine(x, y)
            if (step, rank) in poison:
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
    result = engine.full_state_dict(), engine.skipped_steps
    engine.close()
    return result


def clean_without(rank: int, world: int, stage: int, precision: str, skipped_step: int, steps: int):
    """The reference: the same run in which the poisoned iteration never happened."""
    engine = build(stage, precision)
    for step in range(steps):
        if step == skipped_step:
            continue
        for x, y in rank_micro_batches(step, rank, world, 2, 1):
            engine.backward(engine(x, y))
            engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


SKIP_CASES = [(stage, precision) for stage in (1, 3) for precision in ("fp32", "bf16")]
POISONED_STEP, POISONED_RANK, STEPS = 2, 1, 5


def skip_worker(rank: int, world: int, cases: list[tuple[int, str]]) -> dict:
    """Each case's poisoned run and its reference, in turn."""
    out = {}
    for stage, precision in cases:
        with case(stage=stage, precision=precision, world=world):
            poisoned = train(rank, world, stage, precision, {(POISONED_STEP, POISONED_RANK)}, STEPS)
            reference = clean_without(rank, world, stage, precision, POISONED_STEP, STEPS)
            out[(stage, precision)] = (poisoned, reference)
    return out


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_a_nan_on_one_rank_skips_the_step_on_every_rank() -> None:
    results = run_world(skip_worker, 2, args=(SKIP_CASES,), timeout=600)
    failures = CaseFailures()
    for stage, precision in SKIP_CASES:
        with failures.case(stage=stage, precision=precision, world=2):
            poisoned = [r[(stage, precision)][0] for r in results]
            reference = results[0][(stage, precision)][1]
            state, skipped = poisoned[0]
            assert skipped == 1 and poisoned[1][1] == 1
            for name, value in reference.items():
                assert torch.isfinite(state[name].float()).all(), name
                assert torch.equal(state[name], value), name
    failures.raise_any()


def test_nans_that_keep_coming_stop_training_naming_rank_and_parameter() -> None:
    with pytest.raises(AssertionError) as failure:
        run_world(train, 2, args=(2, "fp32", {(s, 1) for s in range(10)}, 10, 3))
    message = str(failure.value)
    assert message.count("NonFiniteGradientError") >= 2  # every rank stops with the same error
    assert "3 optimizer steps in a row" in message and "rank(s) [1]" in message
    assert "first parameter with a non-finite gradient: 'tok.weight'" in message  # the first in model order
