"""How the ranks meet: the arguments of torch's ``init_process_group``, from the caller's and the launcher's.

[Note: every launch meets through torch]
DeepSpeed's ``init_distributed`` takes an ``init_method`` (``env://``, ``tcp://host:port``,
``file:///path``) and an explicit ``rank`` / ``world_size``; all of them are torch's own rendezvous, so
zeroshard hands them to ``init_process_group`` unchanged and builds its World from the group that results.
Where the caller gives no rank, the launcher's is used (torchrun's, or MPI's / SLURM's, see
[Note: launchers in torchrun's names] in distributed/launch_env.py), so ``tcp://`` under ``srun`` needs no
more arguments than ``env://``.  A caller's rank or world size that contradicts the launcher's, or a
rank without a world size, is refused before any connection: each rank decides from its own arguments,
so a bad combination fails on every rank with the same error instead of some ranks waiting for peers
that never come.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .launch_env import LaunchEnv, LaunchError


@dataclass(frozen=True)
class Rendezvous:
    """``init_process_group``'s ``init_method``, ``rank`` and ``world_size`` (-1: torch reads them from the
    URL or the environment)."""

    init_method: str
    rank: int = -1
    world_size: int = -1


def plan(init_method: Optional[str], rank: int, world_size: int, launch: Optional[LaunchEnv]) -> Optional[Rendezvous]:
    """The rendezvous for these arguments (-1: not given) and this launch; None when there is nothing to
    meet (a lone process: no launcher, no arguments)."""
    given_size = _check_pair(rank, world_size)
    if launch is not None and given_size and (launch.world_size, launch.rank) != (world_size, rank):
        raise LaunchError(f"init_distributed(rank={rank}, world_size={world_size}) but {launch.launcher} started "
                          f"this process as rank {launch.rank} of {launch.world_size}: pass neither (the "
                          f"launcher's are used) or the same")
    if not given_size and launch is not None:
        rank, world_size = launch.rank, launch.world_size
    method = init_method or "env://"
    if init_method is None and not given_size and (launch is None or _alone(launch)):
        return None
    if method.startswith("env://") and launch is None and not given_size:
        raise LaunchError("init_distributed(init_method='env://') but no launcher set RANK and WORLD_SIZE: start "
                          "the job with torchrun, mpirun or srun, or pass rank= and world_size=")
    return Rendezvous(method, rank, world_size)


def _alone(launch: LaunchEnv) -> bool:
    """A single process that MPI or SLURM started (``srun -n 1 pytest``, a batch script's own step): a
    lone process, as without a launcher; torchrun's worlds of one keep their group, as torch makes it."""
    return launch.launcher != "torchrun" and launch.world_size == 1


def check_joined(rank: int, world_size: int, group_rank: int, group_size: int) -> None:
    """Refuse arguments that contradict the process group that already exists."""
    if _check_pair(rank, world_size) and (rank, world_size) != (group_rank, group_size):
        raise LaunchError(f"init_distributed(rank={rank}, world_size={world_size}) but the process group already "
                          f"holds this process as rank {group_rank} of {group_size}")


def _check_pair(rank: int, world_size: int) -> bool:
    """Whether the caller gave a rank and a world size (-1: not given); one without the other, or a rank
    outside the world, is refused."""
    if (rank >= 0) != (world_size >= 0):
        raise LaunchError(f"init_distributed(rank={rank}, world_size={world_size}): give both a rank and a world "
                          f"size, or neither (then the launcher's are used)")
    if world_size >= 0 and not 0 <= rank < world_size:
        raise LaunchError(f"init_distributed(rank={rank}, world_size={world_size}): the rank must be in "
                          f"[0, {world_size})")
    return world_size >= 0
