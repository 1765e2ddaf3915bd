"""A crash at any filesystem operation of a save (new tag or re-saved tag) leaves a loadable checkpoint:
``latest`` always leads to a complete one, the old or the new."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import json, os, pathlib, shutil, sys
    import torch, zeroshard
    from torch import nn

    def engine():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model[0].weight.requires_grad_(False)  # a frozen tensor goes to the extra file
        e, *_ = zeroshard.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1}})
        return e

    def train(e):
        e.backward(e(torch.ones(1, 4)).sum()); e.step()

    root, tag, crash_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    e = engine(); train(e)
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
    os.replace = crashing(os.replace); os.rename = crashing(os.rename); shutil.rmtree = crashing(shutil.rmtree)
    pathlib.Path.rename = crashing(pathlib.Path.rename); pathlib.Path.unlink = crashing(pathlib.Path.unlink)
    pathlib.Path.mkdir = crashing(pathlib.Path.mkdir)
    e.save_checkpoint(root, tag=tag)
    print("OPS", count[0])
""")

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


def run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.nightly  # a sweep: CI runs it in its second step (see conftest.py)
def test_a_crash_at_any_filesystem_operation_leaves_a_loadable_checkpoint(tmp_path) -> None:
    """Re-saving the tag ``latest`` names, the delicate case (a new tag's save killed midway is in
    tests/distributed/test_checkpoint.py)."""
    tag = "last"
    full = run(SCRIPT, str(tmp_path / "count"), tag, "0")
    assert full.returncode == 0, full.stderr
    operations = int(full.stdout.split("OPS")[1])
    assert operations >= 4
    for crash_at in range(1, operations + 1):
        root = tmp_path / f"crash{crash_at}"
        root.mkdir()
        crashed = run(SCRIPT, str(root), tag, str(crash_at))
        assert crashed.returncode == 9, crashed.stderr
        state = load(root)
        old, new = (json.loads((root / f).read_text()) for f in ("old.json", "new.json"))
        assert state in (old, new), f"crash at operation {crash_at}: loaded neither the old nor the new state"
