"""Sharded checkpoints: exact resume, resharding across world sizes and stages, faults, offline tools."""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from zs_common import TINY, make_model, rank_micro_batches, zero_config

import zeroshard
from zeroshard.checkpoint import CheckpointError, CheckpointReader, consolidate
from zeroshard.tools.cli import main as cli_main
from zeroshard.tools.demo.model import GPT
from zeroshard.tools.testing import CaseFailures, WorldFailed, case, run_named_cases, run_world

K = 3
SCHEDULE = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 1e-3, "total_num_steps": 20}}
STAGE3 = {"stage3_param_persistence_threshold": 20}


def make_engine(stage: int, micro: int = 2, **zero):
    config = zero_config(stage, micro, 1, **({**STAGE3, **zero} if stage == 3 else zero))
    config["scheduler"] = SCHEDULE
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=config)
    return engine


def random_step(engine) -> float:
    """One step on a batch drawn from the global RNG: resuming must restore the RNG to repeat it."""
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    y = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return float(loss)


def resume_phase(rank: int, stage: int, phase: str, directory: str, host_page_reuse: bool) -> dict:
    """One run of a resume case: ``full`` trains 2K steps, ``first`` K steps and saves, ``second`` loads
    that save and trains the other K."""
    engine = make_engine(stage, host_page_reuse=host_page_reuse)
    torch.manual_seed(100 + rank)
    losses, loaded = [], None
    if phase == "second":
        path, client = engine.load_checkpoint(directory, load_rng_state=True)  # batches come from torch's RNG
        loaded = (client, path.name)
    steps = {"full": 2 * K, "first": K, "second": K}[phase]
    for _ in range(steps):
        losses.append(random_step(engine))
    if phase == "first":
        engine.save_checkpoint(directory, client_state={"next": K})
    state = engine.full_state_dict()
    result = {"losses": losses, "state": state if rank == 0 else None, "lr": engine.get_lr(),
              "steps": engine.global_steps, "loaded": loaded}
    engine.close()
    return result


def resume_case(rank: int, world: int, stage: int, directory: str, host_page_reuse: bool = True) -> dict:
    """A stage's three runs in turn; each run's engine is closed before the next, so the resumed run
    gets from the first only what its checkpoint holds."""
    return {phase: resume_phase(rank, stage, phase, directory, host_page_reuse)
            for phase in ("full", "first", "second")}


def check_resume(by_rank: list[dict], directory: Path) -> None:
    full, second = ([r[phase] for r in by_rank] for phase in ("full", "second"))
    for a, b in zip(full, second):
        assert b["loaded"] == ({"next": K}, f"global_step{K}"), b["loaded"]
        assert a["losses"][K:] == b["losses"]  # bitwise: the same floats
        assert a["lr"] == b["lr"] and a["steps"] == b["steps"] == 2 * K
    for name, value in full[0]["state"].items():
        assert torch.equal(value, second[0]["state"][name]), name
    assert (directory / "latest").read_text() == f"global_step{K}"


def train_steps(engine, rank: int, world: int, steps) -> list[float]:
    """Train on the fixed batches of ``steps``; the learning rate after each step."""
    lrs = []
    for step in steps:
        for x, y in rank_micro_batches(step, rank, world, 2, 1):
            engine.backward(engine(x, y))
            engine.step()
        lrs.append(engine.get_lr()[0])
    return lrs


def snapshot(engine) -> dict:
    """What a load may restore or keep, part by part (every rank calls it: stage 3 gathers)."""
    buckets = [engine.updater.read_bucket(b) for b in engine.strategy.layout.buckets]
    return {
        "params": engine.full_state_dict(rank0_only=False),  # trained, frozen and buffers
        "moments": {k: torch.cat([state[k] for _, state, _ in buckets]) for k in ("exp_avg", "exp_avg_sq")},
        "adam_step": [float(scalars["step"]) for _, _, scalars in buckets],
        "counters": engine.counters.state_dict(),
        "scheduler": engine.lr_scheduler.state_dict(),
    }


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


LOAD_FLAGS = {
    "all": {},
    "module_only": {"load_module_only": True},
    "no_optimizer": {"load_optimizer_states": False},
    "no_scheduler": {"load_lr_scheduler_states": False},
}


def load_flags_case(rank: int, world: int, stage: int, directory: str) -> dict:
    """A source run saves after 3 steps; for each flag, a different run (other weights, one step of its
    own, so it has moments, counters and a schedule of its own) loads it.  Each part ends up equal to
    the source's ("source") or to the loading run's own ("kept").  ``next_lr``: the learning rate after one
    more step, the source's 4th iteration or the loading run's 2nd."""
    source = make_engine(stage)
    lrs = train_steps(source, rank, world, range(3))
    source.save_checkpoint(directory, tag="src")
    saved = snapshot(source)
    lrs += train_steps(source, rank, world, range(3, 4))
    source.close()
    out = {}
    for name, flags in LOAD_FLAGS.items():
        with case(flags=name):
            out[name] = load_with_flags(rank, world, stage, directory, flags, saved, lrs)
    return out


def load_with_flags(rank: int, world: int, stage: int, directory: str, flags: dict, saved: dict,
                    lrs: list[float]) -> dict:
    """Which parts of a run that loads the source's checkpoint with ``flags`` are the source's."""
    config = zero_config(stage, 2, 1, **(STAGE3 if stage == 3 else {}))
    engine, _, _, _ = zeroshard.initialize(model=make_model(seed=7), config={**config, "scheduler": SCHEDULE})
    train_steps(engine, rank, world, range(10, 11))
    own = snapshot(engine)
    engine.load_checkpoint(directory, tag="src", **flags)
    loaded = snapshot(engine)
    out = {part: "source" if same(loaded[part], saved[part]) else "kept" if same(loaded[part], own[part])
           else "neither" for part in loaded}
    next_lr = train_steps(engine, rank, world, range(3, 4))[0]
    out["next_lr"] = {lrs[3]: "source", lrs[1]: "kept"}.get(next_lr, "neither")
    assert lrs[3] != lrs[1]
    engine.close()
    return out


def global_loss(engine, step: int, world: int, rank: int) -> float:
    (x, y), = rank_micro_batches(step, rank, world, 12 // world, 1)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    value = torch.tensor([float(loss)], dtype=torch.float64)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(value)
    return float(value) / world


Run = tuple[int, int]  # (world, stage)
#: source run -> the runs that load its checkpoint
RESHARDS: dict[Run, list[Run]] = {
    (4, 2): [(1, 2), (2, 2), (3, 2)],  # world 4 -> 1, 2, 3
    (2, 2): [(2, 3)],                  # stage 2 -> 3
    (3, 3): [(2, 2)],                  # stage 3 -> 2 (and world 3 -> 2)
    (2, 0): [(3, 3)],                  # stage 0 -> 3
}


def reshard_rounds(reshards: dict[Run, list[Run]]) -> list[tuple[int, list[Run], list[tuple[Run, Run]]]]:
    """The worlds to run, in order, as (world size, sources it saves, (source, target) loads it runs).

    A world saves every source of its size, then loads every checkpoint already saved into the targets
    of its size; sizes go from the largest down and start over until every target has loaded, so each
    world size runs as few times as the dependencies allow (a world-2 source loaded at world 3 and a
    world-3 source loaded at world 2 need a second round)."""
    pending = [(source, target) for source, targets in reshards.items() for target in targets]
    sizes = sorted({world for world, _ in reshards} | {world for _, (world, _) in pending}, reverse=True)
    saved: set[Run] = set()
    rounds = []
    while pending:
        for world in sizes:
            saves = [source for source in reshards if source[0] == world and source not in saved]
            saved.update(saves)
            loads = [(source, target) for source, target in pending if target[0] == world and source in saved]
            pending = [load for load in pending if load not in loads]
            if saves or loads:
                rounds.append((world, saves, loads))
    return rounds


def source_dir(root: str, source: Run) -> Path:
    return Path(root) / f"world{source[0]}_stage{source[1]}"


def resaved_dir(root: str, source: Run, target: Run) -> Path:
    return source_dir(root, source) / f"to_world{target[0]}_stage{target[1]}"


def reshard_save(rank: int, world: int, stage: int, directory: Path) -> float:
    engine = make_engine(stage, micro=12 // world)
    for step in range(2):
        global_loss(engine, step, world, rank)
    engine.save_checkpoint(directory, tag="source")
    loss = global_loss(engine, 2, world, rank)
    engine.close()
    return loss


def reshard_load(rank: int, world: int, stage: int, source: Path, again: Path) -> float:
    engine = make_engine(stage, micro=12 // world)
    engine.load_checkpoint(source, tag="source")
    engine.save_checkpoint(again, tag="again")
    loss = global_loss(engine, 2, world, rank)
    engine.close()
    return loss


def reshard_worker(rank: int, world: int, saves: list[Run], loads: list[tuple[Run, Run]], root: str) -> dict:
    """One round of RESHARDS: the global loss of the step after each save and after each load."""
    out: dict = {}
    for source in saves:
        with case(save=f"world {source[0]} stage {source[1]}"):
            out[source] = reshard_save(rank, world, source[1], source_dir(root, source))
    for source, target in loads:
        with case(source=f"world {source[0]} stage {source[1]}", target=f"world {target[0]} stage {target[1]}"):
            out[(source, target)] = reshard_load(rank, world, target[1], source_dir(root, source),
                                                 resaved_dir(root, source, target))
    return out


def same_contents(a: Path, b: Path) -> None:
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    assert sorted(ra.param_names()) == sorted(rb.param_names())
    for name in ra.param_names():
        for key in ("param", "optim.exp_avg", "optim.exp_avg_sq"):
            assert torch.equal(ra.tensor(name, key), rb.tensor(name, key)), (name, key)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_load_reshards_across_world_sizes_and_stages(tmp_path: Path) -> None:
    """Every source of RESHARDS and every load of it, one world per round of reshard_rounds."""
    losses: dict = {}
    for world, saves, loads in reshard_rounds(RESHARDS):
        losses.update(run_world(reshard_worker, world, args=(saves, loads, str(tmp_path)), timeout=600)[0])
    failures = CaseFailures()
    for source, targets in RESHARDS.items():
        for target in targets:
            with failures.case(source=f"world {source[0]} stage {source[1]}",
                               target=f"world {target[0]} stage {target[1]}"):
                # parameters and Adam moments, exactly
                same_contents(source_dir(str(tmp_path), source) / "source",
                              resaved_dir(str(tmp_path), source, target) / "again")
                assert losses[(source, target)] == pytest.approx(losses[source], rel=1e-6), (source, target)
    failures.raise_any()


def crash_worker(rank: int, world: int, directory: str, background: bool) -> None:
    engine = make_engine(2)
    random_step(engine)
    engine.save_checkpoint(directory, tag="good", async_save=background)
    random_step(engine)
    import zeroshard.checkpoint.save as saving

    original = saving._write_file

    def dies_after_writing(path, tensors, *rest):  # rank 1 is killed right after writing its shard
        written = original(path, tensors, *rest)
        if rank == 1:
            os._exit(3)
        return written

    saving._write_file = dies_after_writing
    engine.save_checkpoint(directory, tag="bad", async_save=background)
    random_step(engine)  # training goes on while the background save waits for rank 1
    engine.wait_for_checkpoint()


def load_latest_worker(rank: int, world: int, directories: list[str]) -> list[str]:
    """The tag that ``latest`` names in each directory, loaded."""
    names = []
    for directory in directories:
        with case(directory=Path(directory).name, world=world):
            engine = make_engine(2)
            path, _ = engine.load_checkpoint(directory)
            names.append(path.name)
            engine.close()
    return names


@pytest.mark.nightly  # a crash sweep: CI runs it in its second step (see conftest.py)
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    """A killed rank needs a world of its own, one per kind of save; one world then loads both."""
    saves = {"sync": tmp_path / "sync", "async": tmp_path / "async"}
    for name, directory in saves.items():
        with pytest.raises(WorldFailed):  # rank 1 dies; rank 0 fails in whichever collective it is waiting in
            run_world(crash_worker, 2, args=(str(directory), name == "async"), pg_timeout_s=20, timeout=120)
    loaded = run_world(load_latest_worker, 2, args=([str(d) for d in saves.values()],))
    failures = CaseFailures()
    for index, (name, directory) in enumerate(saves.items()):
        with failures.case(save=name, world=2):
            assert (directory / "latest").read_text() == "good"
            assert not (directory / "bad").exists() and (directory / ".bad.incomplete").exists()
            assert [names[index] for names in loaded] == ["good", "good"]
    failures.raise_any()


def saved_worker(rank: int, world: int, directory: str, stage: int) -> dict:
    engine = make_engine(stage, stage3_gather_16bit_weights_on_model_save=True)
    random_step(engine)
    engine.save_checkpoint(directory, tag="t")
    engine.save_16bit_model(directory, "weights16.safetensors")
    return engine.full_state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    directory = tmp_path_factory.mktemp("ckpt")
    state = run_world(saved_worker, 3, args=(str(directory), 3))[0]
    return directory, state


def broken_copy(saved_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(saved_dir / "t", target)
    return target


def test_missing_truncated_and_corrupted_files_are_named(saved, tmp_path: Path) -> None:
    directory = broken_copy(saved[0], tmp_path)
    victim = directory / "rank00001.safetensors"
    data = victim.read_bytes()
    victim.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"rank00001\.safetensors: .* bytes, the manifest says .*truncated"):
        CheckpointReader(directory)
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x10
    victim.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"rank00001\.safetensors: checksum mismatch"):
        CheckpointReader(directory)
    victim.unlink()
    with pytest.raises(CheckpointError, match=r"rank00001\.safetensors: missing"):
        CheckpointReader(directory)


def test_a_flipped_byte_in_the_header_or_the_data_is_caught_and_older_formats_checksums_still_verify(
        saved, tmp_path: Path) -> None:
    """[Note: checksums while writing]: the header and the data are checksummed apart (CRC-32, format
    3); a checkpoint of format 2 (the parts' SHA-256) or 1 (the whole file's SHA-256) still loads, and
    its checksums are verified too."""
    import hashlib
    import zlib
    directory = broken_copy(saved[0], tmp_path)
    victim = directory / "rank00001.safetensors"
    data = victim.read_bytes()
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["format_version"] == 3
    parts = manifest["files"][victim.name]["crc32_parts"]
    split = parts["split"]
    assert (parts["head"], parts["body"]) == (f"{zlib.crc32(data[:split]):08x}", f"{zlib.crc32(data[split:]):08x}")
    for where in (split // 2, split + 5, len(data) - 1):  # header, first data byte block, last byte
        flipped = bytearray(data)
        flipped[where] ^= 0x01
        victim.write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError, match=r"rank00001\.safetensors: checksum mismatch"):
            CheckpointReader(directory)
    victim.write_bytes(data)

    def sha256_parts(raw: bytes, split: int) -> dict:
        return {"split": split, "head": hashlib.sha256(raw[:split]).hexdigest(),
                "body": hashlib.sha256(raw[split:]).hexdigest()}

    older = {2: lambda name, meta: {"bytes": meta["bytes"], "sha256_parts": sha256_parts(
                 (directory / name).read_bytes(), meta["crc32_parts"]["split"])},
             1: lambda name, meta: {"bytes": meta["bytes"],
                                    "sha256": hashlib.sha256((directory / name).read_bytes()).hexdigest()}}
    for version, entry in older.items():
        old = {**manifest, "format_version": version,
               "files": {name: entry(name, meta) for name, meta in manifest["files"].items()}}
        (directory / "manifest.json").write_text(json.dumps(old))
        CheckpointReader(directory)  # verifies
        victim.write_bytes(data[:-1] + bytes([data[-1] ^ 0x01]))
        with pytest.raises(CheckpointError, match=r"rank00001\.safetensors: checksum mismatch"):
            CheckpointReader(directory)
        victim.write_bytes(data)


def verified_files(stage: int, directory: str) -> dict:
    """Load ``directory``'s tag ``t``: the files this rank checksummed, and the error if the load failed."""
    import zeroshard.checkpoint.format as fmt

    hashed, original = [], fmt.file_matches
    fmt.file_matches = lambda path, *a: hashed.append(Path(path).name) or original(path, *a)
    engine = make_engine(stage)
    try:
        engine.load_checkpoint(directory, tag="t")
        error = None
    except CheckpointError as err:
        error = str(err)
    finally:
        fmt.file_matches = original
    engine.close()
    return {"hashed": sorted(hashed), "error": error}


def verifying_worker(rank: int, world: int, directories: list[str], stage: int) -> dict:
    out = {}
    for directory in directories:
        with case(checkpoint=Path(directory).name, world=world, stage=stage):
            out[Path(directory).name] = verified_files(stage, directory)
    return out


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_a_load_verifies_only_the_files_the_rank_reads(saved, tmp_path: Path) -> None:
    intact, damaged = tmp_path / "intact", tmp_path / "damaged"
    for directory in (intact, damaged):
        shutil.copytree(saved[0] / "t", directory / "t")
    extra = ["model_extra.safetensors"] if (intact / "t" / "model_extra.safetensors").exists() else []
    victim = damaged / "t" / "rank00002.safetensors"
    flipped = bytearray(victim.read_bytes())
    flipped[len(flipped) // 2] ^= 0x10
    victim.write_bytes(bytes(flipped))
    at_3 = run_world(verifying_worker, 3, args=([str(intact), str(damaged)], 3), timeout=600)
    whole = run_world(verifying_worker, 1, args=([str(intact)], 2))[0]["intact"]  # one rank reads every chunk
    failures = CaseFailures()
    with failures.case(checkpoint="intact", world=3, stage=3):
        same = [r["intact"] for r in at_3]
        assert [r["hashed"] for r in same] == [sorted([f"rank0000{r}.safetensors", *extra]) for r in range(3)]
        assert all(r["error"] is None for r in same)
    with failures.case(checkpoint="intact", world=1, stage=2):
        assert whole["hashed"] == sorted([f"rank0000{r}.safetensors" for r in range(3)] + extra)
    with failures.case(checkpoint="damaged", world=3, stage=3):
        errors = [r["damaged"]["error"] for r in at_3]
        assert "rank00002.safetensors: checksum mismatch" in errors[2]
        assert all("failed validation on 1 other rank" in e for e in errors[:2])
    failures.raise_any()


def test_a_newer_format_is_refused(saved, tmp_path: Path) -> None:
    directory = broken_copy(saved[0], tmp_path)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["format_version"] = 99
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format version 99 is newer"):
        CheckpointReader(directory)


def wrong_model_case(rank: int, world: int, directory: str, change: str) -> str:
    """The error a model changed by ``change`` raises when it loads the checkpoint."""
    torch.manual_seed(0)
    cfg = TINY.__class__(**{**TINY.__dict__, **({"vocab_size": 67} if change == "shape" else {"n_layer": 3})})
    engine, _, _, _ = zeroshard.initialize(model=GPT(cfg), config=zero_config(2, 1, 1))
    try:
        engine.load_checkpoint(directory, tag="t")
        message = "no error"
    except CheckpointError as err:
        message = str(err)
    engine.close()
    return message


#: how the loading model differs -> what the error must say
WRONG_MODELS = {"shape": "shape mismatch: tok.weight (checkpoint (61, 16), model (67, 16))",
                "layers": "missing from the checkpoint: blocks.2."}


# The cases at world size 2 run in two worlds, each building and closing an engine per case: one for
# the default cases, one for the extended ones.  Each case works in a directory of its own.

#: (stage, host_page_reuse) of each resume case; false is the GPU's path on the CPU (see [Note: one
#: buffer memory per engine] in host/buffer_memory.py)
RESUME_CASES = {"world2": ((2, True), (3, True), (3, False)), "world2_extended": ((0, True), (1, True))}
LOAD_FLAG_STAGES = (2, 3)



def run_cases(world: int, cases: dict[str, tuple[Callable[..., Any], tuple]]) -> dict[str, list[Any]]:
    """Every case in one world: each case's results, by rank."""
    by_rank = run_world(run_named_cases, world, args=(cases,), timeout=600)
    return {name: [r[name] for r in by_rank] for name in cases}


def resume_name(stage: int, host_page_reuse: bool) -> str:
    return f"resume, stage {stage}" + ("" if host_page_reuse else ", host_page_reuse false")


def resume_dir(root: Path, stage: int, host_page_reuse: bool) -> Path:
    return root / (f"resume_stage{stage}" + ("" if host_page_reuse else "_device_path"))


def resume_cases(runs: tuple[tuple[int, bool], ...], root: Path) -> dict[str, tuple[Callable[..., Any], tuple]]:
    return {resume_name(stage, reuse): (resume_case, (stage, str(resume_dir(root, stage, reuse)), reuse))
            for stage, reuse in runs}


@pytest.fixture(scope="module")
def world2(saved, tmp_path_factory) -> tuple[Path, dict[str, list[Any]]]:
    """The default cases: resume at stages 2 and 3 (3 also on the GPU's path), and loads into other models."""
    root = tmp_path_factory.mktemp("world2")
    cases = {**resume_cases(RESUME_CASES["world2"], root),
             **{f"wrong model, {change}": (wrong_model_case, (str(saved[0]), change)) for change in WRONG_MODELS}}
    return root, run_cases(2, cases)


@pytest.fixture(scope="module")
def world2_extended(tmp_path_factory) -> tuple[Path, dict[str, list[Any]]]:
    """The extended cases: resume at stages 0 and 1, and the load flags at stages 2 and 3."""
    root = tmp_path_factory.mktemp("world2_extended")
    cases = {**resume_cases(RESUME_CASES["world2_extended"], root),
             **{f"load flags, stage {stage}": (load_flags_case, (stage, str(root / f"flags_stage{stage}")))
                for stage in LOAD_FLAG_STAGES}}
    return root, run_cases(2, cases)


@pytest.mark.parametrize("world", [pytest.param("world2_extended", marks=pytest.mark.slow, id="stages_0_1"),
                                   pytest.param("world2", id="stages_2_3")])
def test_resume_is_bitwise_exact(world: str, request: pytest.FixtureRequest) -> None:
    """Each resumed run repeats the uninterrupted one bitwise; a stage run on both paths (host pages
    reused, and the GPU's) trains bitwise the same on each."""
    root, results = request.getfixturevalue(world)
    failures = CaseFailures()
    for stage, reuse in RESUME_CASES[world]:
        with failures.case(case=resume_name(stage, reuse), world=2):
            check_resume(results[resume_name(stage, reuse)], resume_dir(root, stage, reuse))
            if not reuse and (stage, True) in RESUME_CASES[world]:
                host, device = results[resume_name(stage, True)], results[resume_name(stage, False)]
                assert [r["full"]["losses"] for r in device] == [r["full"]["losses"] for r in host]
                assert all(torch.equal(value, host[0]["full"]["state"][name])
                           for name, value in device[0]["full"]["state"].items())
    failures.raise_any()


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_load_flags_restore_exactly_what_they_say(world2_extended) -> None:
    """load_module_only: the weights only; load_optimizer_states=False: all but the Adam state (moments
    and step); load_lr_scheduler_states=False: all but the schedule.  Everything else is bitwise the
    checkpoint's, and what is not loaded is bitwise the loading run's own."""
    src, kept = "source", "kept"
    expected = {
        "all": dict(params=src, moments=src, adam_step=src, counters=src, scheduler=src, next_lr=src),
        "module_only": dict(params=src, moments=kept, adam_step=kept, counters=kept, scheduler=kept, next_lr=kept),
        "no_optimizer": dict(params=src, moments=kept, adam_step=kept, counters=src, scheduler=src, next_lr=src),
        "no_scheduler": dict(params=src, moments=src, adam_step=src, counters=src, scheduler=kept, next_lr=kept),
    }
    _, results = world2_extended
    failures = CaseFailures()
    for stage in LOAD_FLAG_STAGES:
        for rank, result in enumerate(results[f"load flags, stage {stage}"]):
            with failures.case(case=f"load flags, stage {stage}", world=2, rank=rank):
                assert result.keys() == expected.keys(), sorted(result)
            for name in LOAD_FLAGS:
                with failures.case(case=f"load flags, stage {stage}", world=2, rank=rank, flags=name):
                    assert result[name] == expected[name], result[name]
    failures.raise_any()


def test_loading_into_a_different_model_names_the_parameters(world2) -> None:
    _, results = world2
    failures = CaseFailures()
    for change, expected in WRONG_MODELS.items():
        for rank, message in enumerate(results[f"wrong model, {change}"]):
            with failures.case(case=f"wrong model, {change}", world=2, rank=rank):
                assert expected in message, message
    failures.raise_any()


def test_consolidate_gives_an_ordinary_state_dict(saved, tmp_path: Path) -> None:
    directory, state = saved
    out = consolidate(directory, tmp_path / "model.safetensors")
    loaded = load_file(str(out))
    model = GPT(TINY)
    model.load_state_dict(loaded, strict=True)
    assert list(loaded) == list(state)
    for name, value in state.items():
        assert torch.equal(loaded[name], value), name
    half = consolidate(directory, tmp_path / "half.safetensors", dtype="bf16")
    assert load_file(str(half))["tok.weight"].dtype == torch.bfloat16
    sixteen = load_file(str(directory / "weights16.safetensors"))
    assert torch.equal(sixteen["head.weight"], state["head.weight"].to(torch.bfloat16))


def cli(*args: str) -> tuple[int, str, str]:
    """`zeroshard <args>` through the command's entry point in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_cli_ckpt_info_and_consolidate(saved, tmp_path: Path) -> None:
    directory = saved[0]
    code, info, _ = cli("ckpt-info", str(directory))
    assert code == 0 and "saved by     world size 3, ZeRO stage 3" in info and "checksums verified" in info
    out = tmp_path / "o.safetensors"
    code, done, _ = cli("consolidate", str(directory), str(out), "--tag", "t")
    assert code == 0 and "wrote" in done and out.is_file()
    code, _, bad = cli("ckpt-info", str(tmp_path / "nothing"))
    assert code == 2 and "no manifest" in bad


class Tower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024, bias=False) for _ in range(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def tower_worker(rank: int, world: int, directory: str) -> None:
    torch.manual_seed(0)
    engine, _, _, _ = zeroshard.initialize(model=Tower(), config={
        "train_batch_size": 4, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 3_000_000}})
    engine.backward(engine(torch.randn(1, 1024)))
    engine.step()
    engine.save_checkpoint(directory, tag="tower")


# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec() from the forked parent (pytest).
CONSOLIDATE_AND_MEASURE = """
import sys
from zeroshard.checkpoint import consolidate
from zeroshard.host.process_memory import host_peak_bytes
before = int(open('/proc/self/statm').read().split()[1]) * 4096
consolidate(sys.argv[1], sys.argv[2])
print(host_peak_bytes() - before)
"""


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_consolidation_memory_is_bounded_by_a_shard_not_the_model(tmp_path: Path) -> None:
    run_world(tower_worker, 4, args=(str(tmp_path),))
    model_bytes = 16 * 1024 * 1024 * 4
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    proc = subprocess.run([sys.executable, "-c", CONSOLIDATE_AND_MEASURE, str(tmp_path / "tower"),
                           str(tmp_path / "tower.safetensors")], capture_output=True, text=True, env=env, check=True)
    growth = int(proc.stdout.strip().splitlines()[-1])
    largest_tensor = 1024 * 1024 * 4
    assert growth < model_bytes / 2, growth  # far from the whole model (64 MiB)
    assert growth < model_bytes / 4 + 2 * largest_tensor, growth  # about a shard (16 MiB) plus a tensor
    assert len(load_file(str(tmp_path / "tower.safetensors"))) == 16
