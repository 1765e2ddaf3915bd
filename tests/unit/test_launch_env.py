"""Launch discovery and rendezvous planning, from tables of environments: torchrun, OpenMPI, MPICH / Intel
MPI and SLURM each give the same rank, world size, local rank and size, node and master in torchrun's
names; contradictory arguments are refused before any connection."""

from __future__ import annotations

from typing import Optional

import pytest

from zeroshard.deepspeed.accelerator import CPUAccelerator
from zeroshard.distributed.launch_env import LaunchEnv, LaunchError, discover, first_host, local_world_size, \
    tasks_per_node
from zeroshard.distributed.rendezvous import Rendezvous, check_joined, plan

#: (case, environment, expected torchrun variables; None: no launcher)
LAUNCHES: list[tuple[str, dict[str, str], Optional[dict[str, str]]]] = [
    ("nothing", {"PATH": "/bin"}, None),
    ("torchrun",
     {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
      "MASTER_ADDR": "h0", "MASTER_PORT": "1234", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8"},
     {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
      "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}),
    ("openmpi, one node: loopback master, default port",
     {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
      "MASTER_PORT": "29500"}),
    ("openmpi, two nodes, MASTER_ADDR exported",
     {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "n0", "MASTER_PORT": "6000"},
     {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n0",
      "MASTER_PORT": "6000"}),
    ("openmpi inside a SLURM allocation: the node list's first host",
     {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "SLURM_JOB_NODELIST": "gpu[07-08]"},
     {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "gpu07",
      "MASTER_PORT": "29500"}),
    ("mpich / intel mpi",
     {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "m"},
     {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "m",
      "MASTER_PORT": "29500"}),
    ("slurm, fixed tasks per node",
     {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2",
      "SLURM_NODEID": "1", "SLURM_NODELIST": "node[01-02]"},
     {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
      "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}),
    ("slurm, uneven tasks per node; the step's count over the allocation's",
     {"SLURM_PROCID": "4", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "5", "SLURM_LOCALID": "0",
      "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_NODEID": "2", "SLURM_NODELIST": "a,b,c", "MASTER_ADDR": "x",
      "MASTER_PORT": "7"},
     {"RANK": "4", "WORLD_SIZE": "5", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "2",
      "MASTER_ADDR": "x", "MASTER_PORT": "7"}),
]


@pytest.mark.parametrize("case,env,expected", LAUNCHES, ids=[case for case, _, _ in LAUNCHES])
def test_discover(case: str, env: dict[str, str], expected: Optional[dict[str, str]]) -> None:
    found = discover(env)
    assert (found.variables() if found else None) == expected, case


def test_discovery_off_reads_torchrun_only() -> None:
    mpi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert discover(mpi, mpi=False) is None
    assert discover({**mpi, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, default_port=6001).master_port == "6001"


#: (case, environment, words of the error)
REFUSED = [
    ("mpi over several nodes without a master", {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0",
                                                 "MPI_LOCALNRANKS": "2"}, "MASTER_ADDR"),
    ("mpi without a local rank", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                                  "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("slurm without a master", {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, "MASTER_ADDR"),
    ("not a number", {"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
]


@pytest.mark.parametrize("case,env,words", REFUSED, ids=[case for case, _, _ in REFUSED])
def test_discover_refuses(case: str, env: dict[str, str], words: str) -> None:
    with pytest.raises(LaunchError, match=words):
        discover(env)


@pytest.mark.parametrize("nodelist,first", [("host", "host"), ("a1,b2", "a1"), ("gpu[003-005,9],cpu1", "gpu003"),
                                            ("n[1-2]-ib", "n1-ib"), ("r[1-2]n[07-9]", "r1n07")])
def test_first_host(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


def test_tasks_per_node() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("8") == [8]
    with pytest.raises(LaunchError):
        tasks_per_node("2x3")


@pytest.mark.parametrize("env,size", [
    ({}, None), ({"LOCAL_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}, 3), ({"LOCAL_WORLD_SIZE": "2"}, 2),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 4), ({"MPI_LOCALNRANKS": "5"}, 5),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS_PER_NODE": "6"}, 6),
    ({"SLURM_PROCID": "0", "SLURM_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "1"}, 1),
])
def test_local_world_size_and_cpu_device_count(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                               size: Optional[int]) -> None:
    assert local_world_size(env) == size
    if size is not None:
        for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert CPUAccelerator().device_count() == size


MPI_RANK_1 = LaunchEnv("openmpi", 1, 2, 1, 2, None, "127.0.0.1", "29500")
ALONE = LaunchEnv("slurm", 0, 1, 0, 1, 0, "127.0.0.1", "29500")
TORCHRUN_ALONE = LaunchEnv("torchrun", 0, 1, 0, 1, None, "127.0.0.1", "29500")

#: (case, init_method, rank, world_size, launch, rendezvous; None: a lone process)
PLANS = [
    ("a lone process", None, -1, -1, None, None),
    ("srun -n 1: lone", None, -1, -1, ALONE, None),
    ("torchrun with one worker keeps its group", None, -1, -1, TORCHRUN_ALONE, Rendezvous("env://", 0, 1)),
    ("a launcher's env://", None, -1, -1, MPI_RANK_1, Rendezvous("env://", 1, 2)),
    ("tcp with explicit ranks", "tcp://h:1", 0, 2, None, Rendezvous("tcp://h:1", 0, 2)),
    ("file with the launcher's ranks", "file:///tmp/x", -1, -1, MPI_RANK_1, Rendezvous("file:///tmp/x", 1, 2)),
    ("tcp with ranks in the URL", "tcp://h:1?rank=0&world_size=2", -1, -1, None,
     Rendezvous("tcp://h:1?rank=0&world_size=2")),
    ("explicit ranks agreeing with the launcher", None, 1, 2, MPI_RANK_1, Rendezvous("env://", 1, 2)),
]


@pytest.mark.parametrize("case,method,rank,size,launch,expected", PLANS, ids=[p[0] for p in PLANS])
def test_plan(case: str, method: Optional[str], rank: int, size: int, launch: Optional[LaunchEnv],
              expected: Optional[Rendezvous]) -> None:
    assert plan(method, rank, size, launch) == expected, case


@pytest.mark.parametrize("method,rank,size,launch,words", [
    ("tcp://h:1", 0, -1, None, "give both"),
    (None, -1, 2, None, "give both"),
    ("tcp://h:1", 2, 2, None, r"\[0, 2\)"),
    (None, 0, 4, MPI_RANK_1, "rank 1 of 2"),
    ("env://", -1, -1, None, "no launcher"),
])
def test_plan_refuses(method: Optional[str], rank: int, size: int, launch: Optional[LaunchEnv], words: str) -> None:
    with pytest.raises(LaunchError, match=words):
        plan(method, rank, size, launch)


def test_check_joined() -> None:
    check_joined(-1, -1, 1, 2)
    check_joined(1, 2, 1, 2)
    with pytest.raises(LaunchError, match="rank 1 of 2"):
        check_joined(0, 4, 1, 2)
    with pytest.raises(LaunchError, match="give both"):
        check_joined(1, -1, 1, 2)
