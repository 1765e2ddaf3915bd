"""Jobs started by every launch method DeepSpeed accepts, as plain ``python`` processes (no torchrun, no
mpirun): ``tcp://`` and ``file://`` with explicit ranks, SLURM's variables and OpenMPI's.  Each pair of
ranks trains at stage 2 on different data and must end with equal parameters (two lone processes would
not); a rank / world size that contradicts the launcher's fails on both ranks with the named error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from zeroshard.tools.testing import free_port

SCRIPT = Path(__file__).parent / "launch_scripts" / "train_stage2.py"
TIMEOUT_S = 120

#: what a launcher of the parent (torchrun, MPI, SLURM) may have left that would be read as this job's
LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "MPI_LOCAL", "SLURM_", "PMIX_")
LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "LOCAL_SIZE"}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_NAMES and not k.startswith(LAUNCHER_PREFIXES)}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def launch(out: Path, rank_command: Callable[[int], tuple[list[str], dict[str, str]]]) -> list[subprocess.CompletedProcess]:
    """Start both ranks at once and wait for them."""
    out.mkdir()
    procs = []
    for rank in range(2):
        args, env = rank_command(rank)
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(out), *args], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    done = []
    for proc in procs:
        try:
            stdout, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            stdout, _ = proc.communicate()
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout))
    return done


def check_trained_together(out: Path, method: str, ranks: list[subprocess.CompletedProcess],
                           expected_env: dict[str, str]) -> None:
    for rank, proc in enumerate(ranks):
        assert proc.returncode == 0, f"{method}: rank {rank} failed\n{proc.stdout[-3000:]}"
    saved = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    for r, one in enumerate(saved):
        assert (one["rank"], one["world_size"]) == (r, 2), method
        for name, value in expected_env.items():
            assert one["env"][name] == value.format(rank=r), (method, name, one["env"])
        if "LOCAL_WORLD_SIZE" in expected_env:  # the accelerator counts the launcher's ranks per node
            assert one["device_count"] == 2, method
    for a, b in zip(saved[0]["params"], saved[1]["params"]):
        assert torch.equal(a, b), f"{method}: the ranks' parameters differ"


@pytest.mark.slow  # extended (a launcher run): runs in CI (see conftest.py)
def test_every_launch_method_trains_one_world(tmp_path: Path) -> None:
    script = ["explicit"]

    def tcp(rank: int) -> tuple[list[str], dict[str, str]]:
        return [*script, f"tcp://127.0.0.1:{port}", str(rank), "2"], clean_env()

    def file(rank: int) -> tuple[list[str], dict[str, str]]:
        return [*script, (tmp_path / "rendezvous").as_uri(), str(rank), "2"], clean_env()

    def slurm(rank: int) -> tuple[list[str], dict[str, str]]:  # what srun -n 2 sets, read by initialize()
        return ["initialize"], clean_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                                         SLURM_NODEID="0", SLURM_TASKS_PER_NODE="2", SLURM_NODELIST="localhost",
                                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    def openmpi(rank: int) -> tuple[list[str], dict[str, str]]:  # mpirun -n 2; the port from distributed_port
        return ["comm"], clean_env(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2",
                                   OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_SIZE="2",
                                   TEST_PORT=str(port))

    launcher_env = {"RANK": "{rank}", "WORLD_SIZE": "2", "LOCAL_RANK": "{rank}", "LOCAL_WORLD_SIZE": "2"}
    cases = [("tcp", tcp, {}), ("file", file, {}),
             ("slurm", slurm, {**launcher_env, "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1"}),
             ("openmpi", openmpi, {**launcher_env, "MASTER_ADDR": "127.0.0.1"})]
    for method, command, expected_env in cases:
        port = free_port()
        if method == "openmpi":
            expected_env = {**expected_env, "MASTER_PORT": str(port)}
        check_trained_together(tmp_path / method, method, launch(tmp_path / method, command), expected_env)

    def contradicts(rank: int) -> tuple[list[str], dict[str, str]]:  # srun's rank 0/1 of 2, told world_size=4
        args, env = slurm(rank)
        return ["explicit", f"tcp://127.0.0.1:{port}", str(rank), "4"], env

    for rank, proc in enumerate(launch(tmp_path / "contradicts", contradicts)):
        assert proc.returncode != 0 and "LaunchError" in proc.stdout and f"rank {rank} of 2" in proc.stdout, \
            proc.stdout[-3000:]
