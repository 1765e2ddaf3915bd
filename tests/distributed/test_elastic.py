"""Elastic fault tolerance: `zeroshard run --max-restarts` + `checkpoint.auto_resume` survives a rank
killed with SIGKILL at any step, and the run finishes bitwise equal to one that was never interrupted.

Each try kills a random rank at a random step (seeded, so a failure can be replayed), two tries in a
row: the restarted group must come up every time (see [Note: restarts need a fresh store]).
"""

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "elastic_scripts" / "train_until_killed.py"
STEPS = 8


def launch(out: Path, victim: int, kill_at: int, restarts: int) -> subprocess.CompletedProcess:
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "zeroshard.tools.cli", "run", "--nproc-per-node", "2", "--max-restarts",
               str(restarts), "--monitor-interval", "0.2", str(SCRIPT), str(out), str(STEPS), str(victim),
               str(kill_at)]
    return subprocess.run(command, capture_output=True, text=True, timeout=240)


@pytest.mark.nightly  # a sweep: CI runs it in its second step (see conftest.py)
def test_a_rank_killed_at_a_random_step_resumes_bitwise_twice_in_a_row(tmp_path: Path) -> None:
    reference = launch(tmp_path / "reference", victim=0, kill_at=-1, restarts=0)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    expected = torch.load(tmp_path / "reference" / "final.pt")
    assert expected["attempt"] == 0 and expected["steps"] == STEPS
    rng = random.Random(2026)
    for attempt in range(2):
        victim, kill_at = rng.randrange(2), rng.randrange(1, STEPS)
        out = tmp_path / f"try{attempt}"
        proc = launch(out, victim, kill_at, restarts=2)
        where = f"try {attempt} (rank {victim} killed after step {kill_at})"
        assert proc.returncode == 0, where + "\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "connectFullMesh" not in proc.stderr, where
        got = torch.load(out / "final.pt")
        assert got["attempt"] == 1, f"{where}: finished on attempt {got['attempt']}, not on the first restart"
        assert got["steps"] == STEPS
        for name, value in expected["state"].items():
            assert torch.equal(got["state"][name], value), f"{where}: {name} differs"
        kept = sorted(p.name for p in (out / "ckpt").iterdir() if not p.name.startswith("."))
        assert kept == ["global_step6", "global_step8", "latest"], (where, kept)
