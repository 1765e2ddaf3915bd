"""Sharded checkpoints: exact resume, resharding across world sizes and stages, faults, offline tools."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from zs_common import TINY, make_model, rank_micro_batches, zero_config

import zeroshard
from zeroshard.checkpoint import CheckpointError, CheckpointReader, consolidate
from zeroshard.tools.demo.model import GPT
from zeroshard.tools.testing import WorldFailed, run_world

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


def resume_worker(rank: int, world: int, stage: int, phase: str, directory: str) -> dict:
    engine = make_engine(stage)
    torch.manual_seed(100 + rank)
    losses = []
    if phase == "second":
        path, client = engine.load_checkpoint(directory, load_rng_state=True)  # batches come from torch's RNG
        assert client == {"next": K} and path.name == f"global_step{K}"
    steps = {"full": 2 * K, "first": K, "second": K}[phase]
    for _ in range(steps):
        losses.append(random_step(engine))
    if phase == "first":
        engine.save_checkpoint(directory, client_state={"next": K})
    state = engine.full_state_dict()
    return {"losses": losses, "state": state if rank == 0 else None, "lr": engine.get_lr(),
            "steps": engine.global_steps}


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), pytest.param(1, marks=pytest.mark.slow), 2, 3])
def test_resume_is_bitwise_exact(stage: int, tmp_path: Path) -> None:
    full = run_world(resume_worker, 2, args=(stage, "full", str(tmp_path)))
    run_world(resume_worker, 2, args=(stage, "first", str(tmp_path)))
    second = run_world(resume_worker, 2, args=(stage, "second", str(tmp_path)))
    for a, b in zip(full, second):
        assert a["losses"][K:] == b["losses"]  # bitwise: the same floats
        assert a["lr"] == b["lr"] and a["steps"] == b["steps"] == 2 * K
    for name, value in full[0]["state"].items():
        assert torch.equal(value, second[0]["state"][name]), name
    assert (tmp_path / "latest").read_text() == f"global_step{K}"


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


def load_flags_worker(rank: int, world: int, stage: int, directory: str) -> dict:
    """A source run saves after 3 steps; for each flag, a different run (other weights, one step of its
    own, so it has moments, counters and a schedule of its own) loads it.  Each part ends up equal to
    the source's ("source") or to the loading run's own ("kept").  ``next_lr``: the learning rate after one
    more step, the source's 4th iteration or the loading run's 2nd."""
    source = make_engine(stage)
    lrs = train_steps(source, rank, world, range(3))
    source.save_checkpoint(directory, tag="src")
    saved = snapshot(source)
    lrs += train_steps(source, rank, world, range(3, 4))
    out = {}
    for name, flags in LOAD_FLAGS.items():
        config = zero_config(stage, 2, 1, **(STAGE3 if stage == 3 else {}))
        engine, _, _, _ = zeroshard.initialize(model=make_model(seed=7), config={**config, "scheduler": SCHEDULE})
        train_steps(engine, rank, world, range(10, 11))
        own = snapshot(engine)
        engine.load_checkpoint(directory, tag="src", **flags)
        loaded = snapshot(engine)
        out[name] = {part: "source" if same(loaded[part], saved[part]) else "kept" if same(loaded[part], own[part])
                     else "neither" for part in loaded}
        next_lr = train_steps(engine, rank, world, range(3, 4))[0]
        out[name]["next_lr"] = {lrs[3]: "source", lrs[1]: "kept"}.get(next_lr, "neither")
        assert lrs[3] != lrs[1]
        engine.close()
    return out


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("stage", [2, 3])
def test_load_flags_restore_exactly_what_they_say(stage: int, tmp_path: Path) -> None:
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
    for result in run_world(load_flags_worker, 2, args=(stage, str(tmp_path))):
        assert result == expected


def global_loss(engine, step: int, world: int, rank: int) -> float:
    (x, y), = rank_micro_batches(step, rank, world, 12 // world, 1)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    value = torch.tensor([float(loss)], dtype=torch.float64)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(value)
    return float(value) / world


def reshard_save_worker(rank: int, world: int, stage: int, directory: str) -> float:
    engine = make_engine(stage, micro=12 // world)
    for step in range(2):
        global_loss(engine, step, world, rank)
    engine.save_checkpoint(directory, tag="source")
    return global_loss(engine, 2, world, rank)


def reshard_load_worker(rank: int, world: int, stage: int, source: str, again: str) -> float:
    engine = make_engine(stage, micro=12 // world)
    engine.load_checkpoint(source, tag="source")
    engine.save_checkpoint(again, tag="again")
    return global_loss(engine, 2, world, rank)


def same_contents(a: Path, b: Path) -> None:
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    assert sorted(ra.param_names()) == sorted(rb.param_names())
    for name in ra.param_names():
        for key in ("param", "optim.exp_avg", "optim.exp_avg_sq"):
            assert torch.equal(ra.tensor(name, key), rb.tensor(name, key)), (name, key)


@pytest.mark.parametrize("source, targets", [
    ((4, 2), [(1, 2), (2, 2), (3, 2)]),  # world 4 -> 1, 2, 3
    ((2, 2), [(2, 3)]),                  # stage 2 -> 3
    ((3, 3), [(2, 2)]),                  # stage 3 -> 2 (and world 3 -> 2)
    ((2, 0), [(3, 3)]),                  # stage 0 -> 3
])
@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_load_reshards_across_world_sizes_and_stages(source, targets, tmp_path: Path) -> None:
    world, stage = source
    expected = run_world(reshard_save_worker, world, args=(stage, str(tmp_path / "a")))[0]
    for new_world, new_stage in targets:
        again = tmp_path / f"b{new_world}{new_stage}"
        losses = run_world(reshard_load_worker, new_world, args=(new_stage, str(tmp_path / "a"), str(again)))
        same_contents(tmp_path / "a" / "source", again / "again")  # parameters and Adam moments, exactly
        assert losses[0] == pytest.approx(expected, rel=1e-6), (new_world, new_stage)


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


def load_latest_worker(rank: int, world: int, directory: str) -> str:
    engine = make_engine(2)
    path, _ = engine.load_checkpoint(directory)
    return path.name


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(background: bool, tmp_path: Path) -> None:
    with pytest.raises(WorldFailed):  # rank 1 dies; rank 0 fails in whichever collective it is waiting in
        run_world(crash_worker, 2, args=(str(tmp_path), background), pg_timeout_s=20, timeout=120)
    assert (tmp_path / "latest").read_text() == "good"
    assert not (tmp_path / "bad").exists() and (tmp_path / ".bad.incomplete").exists()
    assert run_world(load_latest_worker, 2, args=(str(tmp_path),)) == ["good", "good"]


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


def verifying_worker(rank: int, world: int, directory: str, stage: int) -> dict:
    import zeroshard.checkpoint.format as fmt

    hashed, original = [], fmt.file_matches
    fmt.file_matches = lambda path, *a: hashed.append(Path(path).name) or original(path, *a)
    engine = make_engine(stage)
    try:
        engine.load_checkpoint(directory, tag="t")
        error = None
    except CheckpointError as err:
        error = str(err)
    return {"hashed": sorted(hashed), "error": error}


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_a_load_verifies_only_the_files_the_rank_reads(saved, tmp_path: Path) -> None:
    directory = tmp_path / "t"
    shutil.copytree(saved[0] / "t", directory)
    extra = ["model_extra.safetensors"] if (directory / "model_extra.safetensors").exists() else []
    same = run_world(verifying_worker, 3, args=(str(tmp_path), 3))
    assert [r["hashed"] for r in same] == [sorted([f"rank0000{r}.safetensors", *extra]) for r in range(3)]
    assert all(r["error"] is None for r in same)
    whole = run_world(verifying_worker, 1, args=(str(tmp_path), 2))[0]  # one rank reads every chunk
    assert whole["hashed"] == sorted([f"rank0000{r}.safetensors" for r in range(3)] + extra)
    victim = directory / "rank00002.safetensors"
    flipped = bytearray(victim.read_bytes())
    flipped[len(flipped) // 2] ^= 0x10
    victim.write_bytes(bytes(flipped))
    errors = [r["error"] for r in run_world(verifying_worker, 3, args=(str(tmp_path), 3))]
    assert "rank00002.safetensors: checksum mismatch" in errors[2]
    assert all("failed validation on 1 other rank" in e for e in errors[:2])


def test_a_newer_format_is_refused(saved, tmp_path: Path) -> None:
    directory = broken_copy(saved[0], tmp_path)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["format_version"] = 99
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format version 99 is newer"):
        CheckpointReader(directory)


def wrong_model_worker(rank: int, world: int, directory: str, change: str) -> str:
    torch.manual_seed(0)
    cfg = TINY.__class__(**{**TINY.__dict__, **({"vocab_size": 67} if change == "shape" else {"n_layer": 3})})
    engine, _, _, _ = zeroshard.initialize(model=GPT(cfg), config=zero_config(2, 1, 1))
    try:
        engine.load_checkpoint(directory, tag="t")
    except CheckpointError as err:
        return str(err)
    return "no error"


def test_loading_into_a_different_model_names_the_parameters(saved) -> None:
    shape = run_world(wrong_model_worker, 2, args=(str(saved[0]), "shape"))[0]
    assert "shape mismatch: tok.weight (checkpoint (61, 16), model (67, 16))" in shape
    extra = run_world(wrong_model_worker, 2, args=(str(saved[0]), "layers"))[0]
    assert "missing from the checkpoint: blocks.2." in extra


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


def test_cli_ckpt_info_and_consolidate(saved, tmp_path: Path) -> None:
    directory = saved[0]
    info = subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "ckpt-info", str(directory)],
                          capture_output=True, text=True, check=True).stdout
    assert "saved by     world size 3, ZeRO stage 3" in info and "checksums verified" in info
    out = tmp_path / "o.safetensors"
    done = subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "consolidate", str(directory), str(out),
                           "--tag", "t"], capture_output=True, text=True, check=True).stdout
    assert "wrote" in done and out.is_file()
    bad = subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "ckpt-info", str(tmp_path / "nothing")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no manifest" in bad.stderr


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
from zeroshard.engine.metrics import host_peak_bytes
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
