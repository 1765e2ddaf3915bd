"""Who started this process, read from its environment: torchrun, OpenMPI, MPICH / Intel MPI, or SLURM.

A pure function of an environment mapping (:func:`discover`), so every launcher's spelling is tested
from tables of environments.  What it finds is given back in torchrun's names (:meth:`LaunchEnv.variables`),
the names the rest of zeroshard and torch's ``env://`` rendezvous read.

[Note: launchers in torchrun's names]
torchrun tells each worker ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``.  ``mpirun`` and ``srun`` say the same things in their own words
(``OMPI_COMM_WORLD_*``, ``PMI_*``/``MPI_LOCAL*``, ``SLURM_*``).  Translating them once, before the process
group exists, lets ``env://`` rendezvous as under torchrun, and lets every later reader (the device a rank
trains on, the ranks per node of a checkpoint or of an offload budget, the node of each rank) keep reading
torchrun's names.  torchrun's own variables win when present: a launcher started inside an MPI or SLURM
allocation (torchrun under ``srun``) knows the ranks it started.

The master's address is the one thing MPI does not put in the environment: rank 0 could send its own
address to the others over MPI, which needs mpi4py, not a dependency of zeroshard.  So it comes from
``MASTER_ADDR`` when set, from the first host of SLURM's node list inside a SLURM allocation (where
rank 0 runs), and from the loopback address when every rank is on one node; a job over several nodes
with none of these is refused with what to set, rather than each node meeting itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional

DEFAULT_PORT = 29500


class LaunchError(ValueError):
    """The launch is inconsistent or incomplete: missing variables, or a rank / world size that
    contradicts the launcher's."""


@dataclass(frozen=True)
class LaunchEnv:
    """The ranks a launcher started, in torchrun's terms."""

    #: "torchrun", "openmpi", "mpich" or "slurm"
    launcher: str
    rank: int
    world_size: int
    local_rank: int
    #: processes on this node (None: the launcher does not say)
    local_world_size: Optional[int]
    #: this node's index among the job's nodes (None: the launcher does not say; nodes are told
    #: apart by host name)
    node_rank: Optional[int]
    master_addr: Optional[str]
    master_port: Optional[str]

    def variables(self) -> dict[str, str]:
        """torchrun's variables for this launch (those the launcher does not say are left out)."""
        found = {"RANK": self.rank, "WORLD_SIZE": self.world_size, "LOCAL_RANK": self.local_rank,
                 "LOCAL_WORLD_SIZE": self.local_world_size, "GROUP_RANK": self.node_rank,
                 "MASTER_ADDR": self.master_addr, "MASTER_PORT": self.master_port}
        return {name: str(value) for name, value in found.items() if value is not None}


#: launcher -> (rank, world size, local rank, local size) variables
_MPI = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}


def discover(env: Mapping[str, str], default_port: int = DEFAULT_PORT, mpi: bool = True) -> Optional[LaunchEnv]:
    """The launch ``env`` describes (see [Note: launchers in torchrun's names]); None for a process
    that no launcher started.  ``mpi=False``: torchrun's variables only.  ``default_port``: the master's
    port when ``MASTER_PORT`` is unset."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return _torchrun(env)
    if not mpi:
        return None
    for launcher, names in _MPI.items():
        if names[0] in env and names[1] in env:
            return _mpi(env, launcher, names, default_port)
    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        return _slurm(env, default_port)
    return None


def local_world_size(env: Mapping[str, str]) -> Optional[int]:
    """Processes on this node, from whichever launcher said so (DeepSpeed's ``LOCAL_SIZE``, torchrun,
    OpenMPI, MPICH, SLURM); None when none did."""
    for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", _MPI["openmpi"][3], _MPI["mpich"][3]):
        value = _int(env, name)
        if value is not None and value > 0:
            return value
    if "SLURM_PROCID" in env:
        return _slurm_tasks_on_node(env)
    return None


def _torchrun(env: Mapping[str, str]) -> LaunchEnv:
    return LaunchEnv("torchrun", _required(env, "RANK"), _required(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK") or 0,
                     _int(env, "LOCAL_WORLD_SIZE"), _int(env, "GROUP_RANK"), env.get("MASTER_ADDR"),
                     env.get("MASTER_PORT"))


def _mpi(env: Mapping[str, str], launcher: str, names: tuple[str, str, str, str], default_port: int) -> LaunchEnv:
    rank, size = _required(env, names[0]), _required(env, names[1])
    local_size = _int(env, names[3])
    one_node = local_size == size
    master = env.get("MASTER_ADDR") or _slurm_master(env) or ("127.0.0.1" if one_node or size == 1 else None)
    if master is None:
        raise LaunchError(f"{launcher} started {size} ranks over several nodes ({names[3]}={local_size}) but "
                          f"MASTER_ADDR is not set: export MASTER_ADDR=<rank 0's host> (and MASTER_PORT) to "
                          f"every rank, e.g. mpirun -x MASTER_ADDR=... (zeroshard does not ask MPI for it)")
    return LaunchEnv(launcher, rank, size, _required(env, names[2]), local_size, None, master,
                     env.get("MASTER_PORT") or str(default_port))


def _slurm(env: Mapping[str, str], default_port: int) -> LaunchEnv:
    # the step's tasks, which ``srun`` sets: an allocation's own count can be larger than the step's
    rank, size = _required(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS") or _required(env, "SLURM_NTASKS")
    master = env.get("MASTER_ADDR") or _slurm_master(env) or ("127.0.0.1" if size == 1 else None)
    if master is None:
        raise LaunchError("SLURM started this rank but neither MASTER_ADDR nor SLURM_NODELIST is set: export "
                          "MASTER_ADDR=<rank 0's host> to every rank")
    return LaunchEnv("slurm", rank, size, _required(env, "SLURM_LOCALID"), _slurm_tasks_on_node(env),
                     _int(env, "SLURM_NODEID"), master, env.get("MASTER_PORT") or str(default_port))


def _slurm_master(env: Mapping[str, str]) -> Optional[str]:
    """The first host of the step's (else the job's) node list: where SLURM puts task 0."""
    for name in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"):
        if env.get(name):
            return first_host(env[name])
    return None


def _slurm_tasks_on_node(env: Mapping[str, str]) -> Optional[int]:
    """Tasks on this node: ``SLURM_NTASKS_PER_NODE`` when the job asked for a fixed number, else this
    node's entry of the step's (else the job's) ``TASKS_PER_NODE`` list (``"2(x3),1"``)."""
    fixed = _int(env, "SLURM_NTASKS_PER_NODE")
    if fixed:
        return fixed
    node = _int(env, "SLURM_NODEID") or 0
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            counts = tasks_per_node(env[name])
            return counts[node] if node < len(counts) else None
    return None


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed tasks-per-node list, one entry per node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise LaunchError(f"cannot read SLURM's tasks per node {spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def first_host(nodelist: str) -> str:
    """The first host of SLURM's compressed host list: ``"gpu[003-005,9],cpu1"`` -> ``"gpu003"``."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            end = i
            break
    # every bracketed range names its first value (zero padding kept)
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], nodelist[:end].strip())


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


def _required(env: Mapping[str, str], name: str) -> int:
    value = _int(env, name)
    if value is None:
        raise LaunchError(f"{name} is not set: the launcher that set the other rank variables must set it too")
    return value
