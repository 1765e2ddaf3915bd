"""A crash at any filesystem operation of a save (new tag or re-saved tag) leaves a loadable checkpoint:
``latest`` always leads to a complete one, the old or the new."""

import json
import multiprocessing as mp
import os

import pytest
import torch

from zeroshard.tools.testing import PRELOADED


def engine():
    import zeroshard
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)  # a frozen tensor goes to the extra file
    e, *_ = zeroshard.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                 "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1}})
    return e


def save_and_crash(root: str, tag: str, crash_at: int) -> None:
    """Saves tag "last", trains, then re-saves ``tag``, killed (exit 9, no cleanup) at filesystem operation
    ``crash_at`` (0: never; the count goes to ``root``/ops.json).  Runs in a process of its own."""
    import pathlib
    import shutil

    def train(e):
        e.backward(e(torch.ones(1, 4)).sum())
        e.step()

    e = engine()
    train(e)
    e.save_checkpoint(root, tag="last")
    json.dump({k: v.tolist() for k, v in e.module.state_dict().items()}, open(root + "/old.json", "w"))
    train(e)
    json.dump({k: v.tolist() for k, v in e.module.state_dict().items()}, open(root + "/new.json", "w"))
    count = [0]

    def crashing(fn):
        def wrapped(*a, **k):
            count[0] += 1
            if count[0] == crash_at:
                os._exit(9)  # killed, no cleanup
            return fn(*a, **k)
        return wrapped
    os.replace = crashing(os.replace)
    os.rename = crashing(os.rename)
    shutil.rmtree = crashing(shutil.rmtree)
    pathlib.Path.rename = crashing(pathlib.Path.rename)
    pathlib.Path.unlink = crashing(pathlib.Path.unlink)
    pathlib.Path.mkdir = crashing(pathlib.Path.mkdir)
    e.save_checkpoint(root, tag=tag)
    json.dump(count[0], open(root + "/ops.json", "w"))


def load(root) -> dict:
    """A fresh engine (a world of one, in this process) resumes from ``root``'s latest checkpoint."""
    import zeroshard
    from torch import nn

    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    engine, *_ = zeroshard.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                           "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
                                                           "zero_optimization": {"stage": 1}})
    engine.load_checkpoint(root)
    return {k: v.tolist() for k, v in engine.module.state_dict().items()}


def run(root, tag: str, crash_at: int) -> int:
    """:func:`save_and_crash` in a process forked from the suite's preloaded server (see [Note: ranks forked
    from a preloaded server] in zeroshard/tools/testing.py); its exit code."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    proc = ctx.Process(target=save_and_crash, args=(str(root), tag, crash_at))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode is not None, "the saving process hung"
    return proc.exitcode


@pytest.mark.nightly  # a sweep: CI runs it in its second step (see conftest.py)
def test_a_crash_at_any_filesystem_operation_leaves_a_loadable_checkpoint(tmp_path) -> None:
    """Re-saving the tag ``latest`` names, the delicate case (a new tag's save killed midway is in
    tests/distributed/test_checkpoint.py)."""
    tag = "last"
    (tmp_path / "count").mkdir()
    assert run(tmp_path / "count", tag, 0) == 0
    operations = json.loads((tmp_path / "count" / "ops.json").read_text())
    assert operations >= 4
    for crash_at in range(1, operations + 1):
        root = tmp_path / f"crash{crash_at}"
        root.mkdir()
        assert run(root, tag, crash_at) == 9, f"the save did not reach operation {crash_at}"
        state = load(root)
        old, new = (json.loads((root / f).read_text()) for f in ("old.json", "new.json"))
        assert state in (old, new), f"crash at operation {crash_at}: loaded neither the old nor the new state"
