"""Divergent ranks and API misuse get named errors on every rank, never gloo's abort or a hang."""

from pathlib import Path

import pytest
import torch

import zeroshard
from zeroshard.distributed.consistency import DivergenceError, EngineUsageError
from zeroshard.tools.testing import CaseFailures, case, run_world

from zs_common import make_model, rank_micro_batches, zero_config


def diverge(engine, rank: int, world: int, what: str, tmp: str) -> "str | None":
    """Three steps and the saves of ``what``, in which one rank leaves out or changes one call."""
    for step in range(3):
        (x, y), = rank_micro_batches(step, rank, world, 2, 1)
        loss = engine(x, y)
        if what == "skip_backward" and step == 1 and rank == 1:
            engine.step()  # this rank forgot backward()
            continue
        engine.backward(loss)
        if what == "skip_step" and step == 1 and rank == 0:
            continue  # this rank forgot step()
        engine.step()
    if what == "save_on_one_rank":
        if rank == 0:
            engine.save_checkpoint(tmp, tag="one")
        engine.save_checkpoint(tmp, tag="both")
    if what == "different_tags":
        engine.save_checkpoint(tmp, tag=f"rank{rank}")
    if what == "different_tags_warn":  # DeepSpeed's default: saved whole under rank 0's tag, and loadable
        saved = engine.save_checkpoint(tmp, tag=f"rank{rank}")
        path, _ = engine.load_checkpoint(tmp)
        return f"saved at {saved.name}, loaded {path.name if path else None}"
    return None


def diverging(rank: int, world: int, stage: int, what: str, tmp: str) -> str:
    """The error ``what`` raises on this rank; the engine is closed after a named error, which every rank
    raises before any collective of the divergent call, so the next engine starts from a clean world."""
    validation = "Warn" if what == "different_tags_warn" else "FAIL"  # any case, as DeepSpeed reads it
    engine, *_ = zeroshard.initialize(model=make_model(), config={**zero_config(stage, 2, 1), "collective_timeout": 20,
                                                                  "checkpoint": {"tag_validation": validation}})
    try:
        message = diverge(engine, rank, world, what, tmp) or "no error"
    except DivergenceError as err:
        message = str(err)
    engine.close()
    return message


DIVERGENCES = [(1, "skip_backward"), (3, "skip_backward"), (1, "skip_step"), (3, "skip_step"),
               (2, "save_on_one_rank"), (3, "different_tags"), (2, "different_tags_warn")]


def divergence_worker(rank: int, world: int, cases: list[tuple[int, str]], tmp: str) -> dict[tuple[int, str], str]:
    """Each divergence in turn, each on an engine of its own: a named error leaves the world usable."""
    out = {}
    for stage, what in cases:
        with case(stage=stage, divergence=what, world=world):
            out[(stage, what)] = diverging(rank, world, stage, what, str(Path(tmp) / f"{what}_stage{stage}"))
    return out


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_divergence_is_a_named_error_on_every_rank(tmp_path) -> None:
    results = run_world(divergence_worker, 2, args=(DIVERGENCES, str(tmp_path)), pg_timeout_s=30, timeout=600)
    failures = CaseFailures()
    for stage, what in DIVERGENCES:
        with failures.case(stage=stage, divergence=what, world=2):
            messages = [r[(stage, what)] for r in results]
            if what in ("different_tags", "save_on_one_rank"):  # the first save names a different tag on each rank
                assert all(m.startswith("ranks named different checkpoints") and m.endswith("nothing was saved")
                           for m in messages), messages
            elif what == "different_tags_warn":
                assert messages == ["saved at rank0, loaded rank0"] * 2, messages
            else:
                assert all(m.startswith("ranks diverged") for m in messages), messages
    failures.raise_any()


def test_api_misuse_is_refused() -> None:
    engine, *_ = zeroshard.initialize(model=make_model(), config=zero_config(1, 2, 1))
    (x, y), = rank_micro_batches(0, 0, 1, 2, 1)
    with pytest.raises(EngineUsageError, match="without a backward"):
        engine.step()
    engine.backward(engine(x, y))
    with pytest.raises(EngineUsageError, match="twice at a gradient accumulation boundary"):
        engine.backward(engine(x, y))
    engine.step()
    with pytest.raises(EngineUsageError, match="without a backward"):
        engine.step()


def crossed_orders(rank: int, world: int) -> str:
    """Both ranks record a reduce-scatter and an all-gather of the same size on the engine's group, in
    opposite orders (what pairing one with the other would look like): the next call must refuse."""
    from zeroshard.distributed.collectives import CommKind, CommScope

    engine, *_ = zeroshard.initialize(model=make_model(), config=zero_config(2, 2, 1))
    (x, y), = rank_micro_batches(0, rank, world, 2, 1)
    engine.backward(engine(x, y))
    engine.step()
    kinds = [CommKind.REDUCE_SCATTER, CommKind.ALL_GATHER]
    for kind in kinds if rank == 0 else reversed(kinds):
        engine.comm.ledger.record(kind, "crossed", engine.world, CommScope.INSIDE_NODE, 4096, 2048)
    try:
        engine.backward(engine(x, y))
    except DivergenceError as err:
        return str(err)
    return "no error"


def test_collectives_issued_in_different_orders_are_a_named_error_on_every_rank() -> None:
    messages = run_world(crossed_orders, 2, pg_timeout_s=30, timeout=120)
    assert all(m.startswith("ranks diverged") and "order of collectives" in m for m in messages), messages
