"""Asynchronous checkpoint saves (``async_save=True`` / ``checkpoint.writer.decoupled``): the state of the
instant of the save, written while training goes on, published by the same rules; faults are never
silent; the next save, a load and ``close()`` wait for the one in flight."""

import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file
from zs_common import TINY, make_model, zero_config

import zeroshard
import zeroshard.checkpoint.save as saving
from zeroshard.checkpoint import CheckpointError
from zeroshard.tools.testing import CaseFailures, case, run_world

STAGE3 = {"stage3_param_persistence_threshold": 20}


def make_engine(stage: int, **extra):
    config = zero_config(stage, 2, 1, **(STAGE3 if stage == 3 else {}))
    config.update(extra)
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=config)
    return engine


def step(engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len), generator=g)
    y = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len), generator=g)
    engine.backward(engine(x, y))
    engine.step()


def held_writer():
    """Patch the rank-file writer so that it waits for ``release`` before writing (a slow disk)."""
    release, original = threading.Event(), saving._write_file

    def slow(path, tensors, *rest):
        assert release.wait(60)
        return original(path, tensors, *rest)

    saving._write_file = slow
    return release, original


def late_copy():
    """Patch the copy into the staging buffers so that it starts only after ``save_checkpoint`` has
    returned and the next step is under way (a copy slower than the next forward and backward)."""
    returned, original = threading.Event(), saving.StagingBuffers.stage

    def late(self, tensors):
        assert returned.wait(30), "the copy ran before save_checkpoint returned"
        time.sleep(0.3)  # the next step's forward and backward take less on this tiny model
        return original(self, tensors)

    saving.StagingBuffers.stage = late
    return returned, original


def same_state_case(rank: int, stage: int, directory: str) -> dict:
    """A synchronous save and an asynchronous one of the same instant, written while training goes on."""
    engine = make_engine(stage)
    torch.manual_seed(rank)
    step(engine, 1)
    engine.save_checkpoint(directory, tag="sync", client_state={"at": 1})
    release, original = held_writer()
    returned, original_stage = late_copy()
    try:
        client = {"at": 1}
        path = engine.save_checkpoint(directory, tag="async", client_state=client, async_save=True)
        returned.set()  # the copy starts now: the step below must wait for it before updating
        client["at"] = 99  # the script changes its state: the save has its own copy
        for seed in (2, 3):  # training goes on, changing every parameter and moment, while the save waits
            step(engine, seed)
        pending = engine.saves.pending
        published_early = (Path(directory) / "async").exists()
        release.set()
        done = engine.wait_for_checkpoint()
    finally:
        release.set()
        returned.set()
        saving._write_file, saving.StagingBuffers.stage = original, original_stage
    engine.close()
    return {"pending": str(pending), "published_early": published_early, "done": str(done), "path": str(path),
            "latest": (Path(directory) / "latest").read_text()}


def same_state_worker(rank: int, world: int, stages: tuple[int, ...], root: str) -> dict:
    out = {}
    for stage in stages:
        with case(stage=stage, world=world):
            out[stage] = same_state_case(rank, stage, str(Path(root) / f"stage{stage}"))
    return out


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("world, stages", [(2, (1, 2)), (3, (3,))], ids=["world2", "world3"])
def test_an_async_save_holds_the_state_of_its_instant(world: int, stages: tuple[int, ...], tmp_path: Path) -> None:
    results = run_world(same_state_worker, world, args=(stages, str(tmp_path)), timeout=600)
    failures = CaseFailures()
    for stage in stages:
        with failures.case(stage=stage, world=world):
            directory = tmp_path / f"stage{stage}"
            for r in (result[stage] for result in results):
                assert r["pending"] == r["done"] == r["path"] == str(directory / "async")
                assert not r["published_early"] and r["latest"] == "async"
            sync, background = directory / "sync", directory / "async"
            files = sorted(p.name for p in sync.glob("*.safetensors"))
            assert files == sorted(p.name for p in background.glob("*.safetensors")) and len(files) >= world
            for name in files:  # byte for byte the tensors of the synchronous save of the same instant
                a, b = load_file(sync / name), load_file(background / name)
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
            m_sync, m_async = (json.loads((d / "manifest.json").read_text()) for d in (sync, background))
            for key in ("buckets", "optimizer", "engine", "lr_scheduler", "client_state", "model"):
                assert m_sync[key] == m_async[key], key
            assert m_async["client_state"] == {"at": 1}
    failures.raise_any()


def lent_chunks_worker(rank: int, world: int, directory: str) -> dict:
    """Stage 3 lends a gathered unit this rank's chunk ([Note: a gathered unit borrows this rank's
    chunk]): not while an asynchronous save copies the chunks.  The copy here runs exactly while the
    next forward's units are gathered."""
    engine = make_engine(3)
    for seed in (1, 2):  # the second forward follows the recorded order: its units stay gathered
        step(engine, seed)
    engine.save_checkpoint(directory, tag="sync")
    go, copied, original = threading.Event(), threading.Event(), saving.StagingBuffers.stage

    def when_told(self, tensors):
        assert go.wait(30), "the forward never started the copy"
        try:
            return original(self, tensors)
        finally:
            copied.set()

    saving.StagingBuffers.stage = when_told
    engine.save_checkpoint(directory, tag="async", async_save=True)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len), generator=g)
    loss = engine(x, x)  # every unit gathered now, until backward
    go.set()
    assert copied.wait(30)
    lent_during_copy = engine.storage.lent_bytes()
    engine.backward(loss)
    engine.step()
    engine.wait_for_checkpoint()
    saving.StagingBuffers.stage = original
    step(engine, 4)
    lent_later = []
    loss = engine(x, x)
    lent_later.append(engine.storage.lent_bytes())
    engine.backward(loss)
    engine.step()
    engine.close()
    return {"lent_during_copy": lent_during_copy, "lent_later": lent_later}


def test_stage3_lends_no_chunk_while_an_async_save_copies_them(tmp_path: Path) -> None:
    results = run_world(lent_chunks_worker, 3, args=(str(tmp_path),))
    for r in results:
        assert r["lent_during_copy"] == 0 and r["lent_later"][0] > 0, r
    sync, background = tmp_path / "sync", tmp_path / "async"
    files = sorted(p.name for p in sync.glob("*.safetensors"))
    assert files == sorted(p.name for p in background.glob("*.safetensors")) and len(files) >= 3
    for name in files:  # byte for byte the tensors of the synchronous save of the same instant
        a, b = load_file(sync / name), load_file(background / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def resume_phase(rank: int, directory: str, phase: str) -> list:
    engine = make_engine(3, checkpoint={"writer": {"decoupled": True}})
    if phase == "resume":
        engine.load_checkpoint(directory)
    losses = []
    for seed in range(3):
        if phase == "first" and seed == 1:
            engine.save_checkpoint(directory)  # the config makes it asynchronous
        g = torch.Generator().manual_seed(seed + (1 if phase == "resume" else 0))
        x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len), generator=g)
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    engine.close()  # waits for the save in flight
    return losses


def resume_worker(rank: int, world: int, directory: str) -> dict:
    """The run that saves, then (its engine closed, so only the files carry the state) the run that resumes."""
    out = {}
    for phase in ("first", "resume"):
        with case(phase=phase, stage=3, world=world):
            out[phase] = resume_phase(rank, directory, phase)
    return out


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_the_config_key_saves_in_the_background_and_resume_is_exact(tmp_path: Path) -> None:
    results = run_world(resume_worker, 2, args=(str(tmp_path),))
    assert (tmp_path / "latest").read_text() == "global_step1"
    first, resumed = ([r[phase] for r in results] for phase in ("first", "resume"))
    assert [r[:2] for r in resumed] == [f[1:] for f in first]  # bitwise: the steps after the save repeat


def failing_case(rank: int, directory: str) -> list:
    engine = make_engine(2)
    step(engine, 1)
    engine.save_checkpoint(directory, tag="good", async_save=True)
    original = saving._write_file

    def full_disk(path, tensors, *rest):  # only for "bad": "good" may still be being written now
        if rank == 1 and ".bad.incomplete" in str(path):
            raise OSError(28, "No space left on device", str(path))
        return original(path, tensors, *rest)

    errors = []
    saving._write_file = full_disk
    try:
        step(engine, 2)
        engine.save_checkpoint(directory, tag="bad", async_save=True)  # waits for "good" first
        step(engine, 3)
        try:
            engine.wait_for_checkpoint()
        except CheckpointError as err:
            errors.append(str(err))
    finally:
        saving._write_file = original
    original_stage = saving.StagingBuffers.stage

    def no_memory(self, tensors):
        if rank == 1:
            raise RuntimeError("out of memory (injected)")
        return original_stage(self, tensors)

    saving.StagingBuffers.stage = no_memory
    try:
        engine.save_checkpoint(directory, tag="uncopied", async_save=True)
        step(engine, 4)  # does not wait forever for a copy that failed
        try:
            engine.wait_for_checkpoint()
        except CheckpointError as err:
            errors.append(str(err))
    finally:
        saving.StagingBuffers.stage = original_stage
    engine.save_checkpoint(directory, tag="again", async_save=True)  # the engine saves again after a failure
    engine.close()
    return errors


def periodic_case(rank: int, directory: str) -> list:
    engine = make_engine(1, checkpoint={"save_dir": directory, "save_interval": 1, "keep_last": 2,
                                        "writer": {"decoupled": True, "io_buffer_size": 4096}})
    for seed in range(5):
        step(engine, seed)
    engine.close()
    return sorted(p.name for p in Path(directory).iterdir() if not p.name.startswith("."))


def paced_case(rank: int, directory: str) -> dict:
    engine = make_engine(2, checkpoint={"writer": {"type": "python", "io_buffer_size": 4096, "spread_over_steps": 4}})
    step(engine, 1)
    engine.save_checkpoint(directory, tag="sync")
    engine.save_checkpoint(directory, tag="paced", async_save=True)
    pacing = engine.saves._pacing
    seen = []
    for s in range(3):
        time.sleep(0.3)  # the writer goes as far as its share lets it
        seen.append({"taken": pacing._taken, "total": pacing._total,
                     "published": (Path(directory) / "paced").exists()})
        step(engine, 2 + s)
    done = engine.wait_for_checkpoint()
    # a share of one byte a step: only a wait lets the rest go
    engine.config = replace(engine.config, checkpoint=replace(engine.config.checkpoint, writer=replace(
        engine.config.checkpoint.writer, spread_over_steps=10**9)))
    engine.save_checkpoint(directory, tag="lifted", async_save=True)
    lifted = engine.wait_for_checkpoint()
    engine.close()
    return {"seen": seen, "done": str(done), "lifted": str(lifted)}


#: the cases at world 2 run in one world (stage 2, 1, 2), each saving into a directory of its own
WORLD2_CASES: dict[str, tuple[int, Callable[[int, str], Any]]] = {
    "failing": (2, failing_case), "periodic": (1, periodic_case), "paced": (2, paced_case)}


def world2_worker(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, (stage, run) in WORLD2_CASES.items():
        with case(case=name, stage=stage, world=world):
            out[name] = run(rank, str(Path(root) / name))
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Every case of WORLD2_CASES, in one world: the root of their directories and each rank's results."""
    root = tmp_path_factory.mktemp("async_world2")
    return root, run_world(world2_worker, 2, args=(str(root),), timeout=600)


def test_a_failed_background_save_raises_on_every_rank_and_publishes_nothing(world2) -> None:
    root, results = world2
    directory = root / "failing"
    for rank_errors in (r["failing"] for r in results):
        assert len(rank_errors) == 2
        assert "rank 1 could not write its files" in rank_errors[0] and "No space left on device" in rank_errors[0]
        assert "'bad'" in rank_errors[0]
        assert "rank 1 could not write its files (its state could not be copied (RuntimeError: out of memory " \
               "(injected)))" in rank_errors[1] and "'uncopied'" in rank_errors[1]
    assert not (directory / "bad").exists() and not (directory / "uncopied").exists() and (directory / "good" / "manifest.json").is_file()
    assert (directory / "latest").read_text() == "again"


def test_periodic_async_saves_prune_after_each_is_published(world2) -> None:
    root, results = world2
    kept = results[0]["periodic"]
    assert kept == ["global_step4", "global_step5", "latest"]
    assert (root / "periodic" / "latest").read_text() == "global_step5"


def test_a_save_spread_over_steps_writes_a_share_per_step_and_a_wait_lifts_the_pace(world2) -> None:
    root, results = world2
    directory = root / "paced"
    for r in (result["paced"] for result in results):
        assert r["done"] == str(directory / "paced") and r["lifted"] == str(directory / "lifted")
        for steps, seen in enumerate(r["seen"]):
            assert not seen["published"], steps  # the last quarter waits for the third step
            share = -(-seen["total"] * (steps + 1) // 4)
            assert seen["taken"] <= share + 4095, (steps, seen)  # a piece starts only within the share
    assert (directory / "latest").read_text() == "lifted"
    for name in sorted(p.name for p in (directory / "sync").glob("*.safetensors")):
        a, b = load_file(directory / "sync" / name), load_file(directory / "paced" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
