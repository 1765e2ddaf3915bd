"""A load is all or nothing: a damaged or mismatched checkpoint raises on every rank and changes nothing.

Every case below is one that used to half-load the engine (parameters overwritten, then a KeyError),
crash with an AttributeError, load a file without checking it, or give each rank a different
checkpoint.  Each rank snapshots everything a load can touch (parameters and masters, optimizer state
as sharded, hyperparameters, counters, LR schedule, RNG), tries the load, and compares.
"""

import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from zs_common import make_model, rank_micro_batches, zero_config

import zeroshard
from zeroshard.checkpoint import FORMAT_VERSION
from zeroshard.checkpoint import CheckpointError
from zeroshard.distributed.consistency import DivergenceError
from zeroshard.tools import testing
from zeroshard.tools.testing import CaseFailures, run_world


def _manifest_edit(edit: Callable[[Any], Any]) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        path = directory / "manifest.json"
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return damage


def _drop(key: str) -> Callable[[Any], Any]:
    return lambda m: {k: v for k, v in m.items() if k != key}


def _unlist_rank1(m: dict) -> dict:
    m["files"].pop("rank00001.safetensors")
    return m


def _string_counter(m: dict) -> dict:
    m["engine"]["global_steps"] = str(m["engine"]["global_steps"])
    return m


def _string_version(m: dict) -> dict:
    m["format_version"] = str(m["format_version"])
    return m


def _truncate_rank1(directory: Path) -> None:
    victim = directory / "rank00001.safetensors"
    victim.write_bytes(victim.read_bytes()[:-64])


#: case -> (how the copy is damaged, what the failing rank's error must say)
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "no engine entry": (_manifest_edit(_drop("engine")), r"manifest\.json: entry 'engine' is missing or not an object"),
    "no optimizer entry": (_manifest_edit(_drop("optimizer")), r"manifest\.json: entry 'optimizer' is missing"),
    "no world_size entry": (_manifest_edit(_drop("world_size")), r"manifest\.json: entry 'world_size' is missing or not an integer"),
    "manifest is a list": (_manifest_edit(lambda m: [m]), r"manifest\.json: not a zeroshard checkpoint manifest"),
    "manifest is null": (_manifest_edit(lambda m: None), r"manifest\.json: not a zeroshard checkpoint manifest"),
    "rank file not listed": (_manifest_edit(_unlist_rank1), r"does not list rank00001\.safetensors"),
    "counter not an int": (_manifest_edit(_string_counter), r"engine\.global_steps is missing or not an integer"),
    "version not an int": (_manifest_edit(_string_version), rf"entry 'format_version' is '{FORMAT_VERSION}', not a positive integer"),
    "rank file truncated": (_truncate_rank1, r"rank00001\.safetensors: .* bytes, the manifest says"),
}


def snapshot(engine) -> dict[str, Any]:
    """Everything a load may change, copied."""
    shards = engine.checkpoint_parts().shards
    out: dict[str, Any] = {}
    for bucket in shards.layout.buckets:
        values, state, scalars = shards.read_bucket(bucket)
        out[f"values{bucket.index}"] = values.clone()
        out.update({f"state{bucket.index}.{k}": v.clone() for k, v in state.items()})
        out.update({f"scalar{bucket.index}.{k}": v.clone() for k, v in scalars.items()})
    out.update({f"model.{n}": t for n, t in engine.full_state_dict(rank0_only=False).items()})
    out["hyper"] = json.dumps(engine.checkpoint_parts().optimizer.state_dict(), sort_keys=True, default=str)
    out["counters"] = (engine.global_steps, engine.micro_steps, engine.global_samples, engine.skipped_steps)
    out["lr"] = engine.get_lr()
    out["scheduler"] = json.dumps(engine.lr_scheduler.state_dict(), sort_keys=True, default=str)
    out["rng"] = torch.get_rng_state()
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    differ = [k for k in a if k not in b]
    for k, v in a.items():
        if k in b and (not torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v != b[k]):
            differ.append(k)
    return differ


def train(engine, rank: int, world: int, steps: int) -> None:
    for step in range(steps):
        for x, y in rank_micro_batches(step, rank, world, 2, 1):
            engine.backward(engine(x, y))
        engine.step()


def load_attempts(rank: int, world: int, stage: int, directory: str) -> dict[str, Any]:
    """Every damaged or mismatched load at ``stage``: its error and what it changed, by case."""
    root = Path(directory)
    config = zero_config(stage, 2, 1, **({"stage3_param_persistence_threshold": 20} if stage == 3 else {}))
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-3}}
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=config)
    train(engine, rank, world, 1)
    engine.save_checkpoint(root, tag="a")
    train(engine, rank, world, 2)
    engine.save_checkpoint(root, tag="b")
    train(engine, rank, world, 1)  # the engine now differs from both checkpoints
    results: dict[str, Any] = {}
    for case, (damage, _) in CASES.items():
        broken = root / case.replace(" ", "_")
        if rank == 0:
            shutil.copytree(root / "b", broken / "b")
            (broken / "latest").write_text("b")
            damage(broken / "b")
        dist.barrier()
        before = snapshot(engine)
        try:
            engine.load_checkpoint(broken, load_rng_state=True)
            error = "loaded"
        except CheckpointError as err:
            error = str(err)
        results[case] = (error, same(before, snapshot(engine)))
    # Two ways ranks can open different checkpoints; they must not get a mix of both.
    elsewhere = root / "elsewhere"
    if rank == 0:
        shutil.copytree(root / "a", elsewhere / "b")  # same tag, other contents
        (elsewhere / "latest").write_text("b")
    dist.barrier()
    for case, directory, tag in (("different tags", root, "a" if rank == 0 else "b"),
                                 ("different directories", root if rank == 0 else elsewhere, None)):
        before = snapshot(engine)
        try:
            engine.load_checkpoint(directory, tag=tag, load_rng_state=True)
            error = "loaded"
        except DivergenceError as err:
            error = str(err)
        results[case] = (error, same(before, snapshot(engine)))
    engine.load_checkpoint(root, tag="a")  # after all that, a good checkpoint still loads
    results["good"] = engine.global_steps
    engine.close()
    return results


def worker(rank: int, world: int, stages: tuple[int, ...], directory: str) -> dict[int, dict[str, Any]]:
    """Each stage's loads in turn, from checkpoints of its own directory."""
    out = {}
    for stage in stages:
        with testing.case(stage=stage, world=world):
            out[stage] = load_attempts(rank, world, stage, str(Path(directory) / f"stage{stage}"))
    return out


STAGES = (1, 3)


def test_a_bad_checkpoint_raises_on_every_rank_and_changes_nothing(tmp_path: Path) -> None:
    by_rank = run_world(worker, 2, args=(STAGES, str(tmp_path)), timeout=600)
    failures = CaseFailures()
    for stage in STAGES:
        with failures.case(stage=stage, world=2):
            check_stage([r[stage] for r in by_rank])
    failures.raise_any()


def check_stage(ranks: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(ranks):
        assert results.pop("good") == 1
        for case, (error, changed) in results.items():
            assert error != "loaded", f"rank {rank}: {case} loaded"
            assert not changed, f"rank {rank}: {case} changed {changed}"
    for case, (_, expected) in CASES.items():
        messages = [ranks[r][case][0] for r in range(2)]
        # the damaged file's message, on the rank that found it; the others name the failing rank(s)
        assert any(re.search(expected, m) for m in messages), (case, messages)
    for r in range(2):
        assert re.search(r"named different checkpoints .*rank 0: checkpoint \d+; rank 1: checkpoint \d+", ranks[r]["different tags"][0])
        assert re.search(r"named different checkpoints .*rank 0: checkpoint \d+; rank 1: checkpoint \d+",
                         ranks[r]["different directories"][0]), ranks[r]["different directories"][0]
