"""A finished run exits 0 every time (see [Note: a clean exit] in zeroshard/distributed/world.py)."""

import os
import subprocess
import sys

import pytest

from zeroshard.tools.testing import free_port

JOB = """
import atexit, os, torch, zeroshard

def gloo_threads_left():  # registered first, so it runs after zeroshard's exit handler
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    left = sum(name.startswith(("pt_gloo", "gloo")) for name in names)
    os.write(1, f"gloo threads at exit: {left}\\n".encode())  # one write: the ranks share the pipe

atexit.register(gloo_threads_left)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
engine, *_ = zeroshard.initialize(model=model, config={
    "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 40}})
losses = []
for _ in range(3):
    loss = engine(torch.randn(2, 8)).sum()
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
# as Accelerate's gather() ends a run: a plain collective on tensors Python lets go of at once
gathered = [torch.zeros(3) for _ in range(torch.distributed.get_world_size())]
torch.distributed.all_gather(gathered, torch.tensor(losses))
print("finished", flush=True)
"""


@pytest.mark.nightly  # a sweep: CI runs it in its second step (see conftest.py)
def test_four_finished_runs_in_a_row_all_exit_zero(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for attempt in range(4):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(free_port()), str(script)],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, f"run {attempt}: {proc.stdout[-1000:]}{proc.stderr[-3000:]}"
        assert proc.stdout.count("finished") == 2
        assert proc.stdout.count("gloo threads at exit: 0") == 2, proc.stdout  # every group freed in time
