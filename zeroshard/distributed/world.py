"""Who we are in the job: rank, world size, device and process group, in one object that is passed around.

zeroshard never keeps process groups in globals of its own: the engine builds one :class:`World` and
hands it to every part that communicates.  The ranks meet through torch's own rendezvous, however the
job was launched (torchrun, mpirun, srun, or ``tcp://`` / ``file://`` with explicit ranks); a single
process started by none of them gets a world of size 1 with no process group at all.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..device.policy import DevicePolicy, device_policy
from .launch_env import DEFAULT_PORT, discover
from .rendezvous import check_joined, plan

DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class World:
    """The data-parallel world this rank belongs to."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    #: the backend of the world's collectives on ``device`` ("gloo", "nccl"), "none" for a lone process
    backend: str
    #: None: the default (whole-world) group, without holding a reference to it (see [Note: a clean exit])
    group: Optional[dist.ProcessGroup] = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: whether the group's ranks are on more than one node (its collectives then cross the network)
    spans_nodes: bool = False
    #: a world over part of the job (one pipeline stage's data-parallel ranks): the global ranks of
    #: every such part, this one among them (see [Note: side groups of a partial world])
    parts: tuple[tuple[int, ...], ...] = ()
    #: a world of one that issues its collectives as a larger world would (config
    #: ``collectives_in_a_world_of_one``; only with a process group)
    collectives_at_one: bool = False
    #: what the parts ask of ``device``, derived from it when the world is made (see [Note: the device
    #: decided once] in device/policy.py)
    device_policy: DevicePolicy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_policy", device_policy(self.device))

    @property
    def is_distributed(self) -> bool:
        """Whether collectives are issued: more than one rank, or a world of one told to."""
        return self.world_size > 1 or self.collectives_at_one

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def new_side_group(world: World, ranks: Optional[Sequence[int]] = None,
                   backend: Optional[str] = None) -> Optional[dist.ProcessGroup]:
    """[Note: side groups of a partial world]
    ``dist.new_group`` must be entered by every rank of the job, in the same order, with the same ranks,
    members or not.  A world over part of the job (each pipeline stage trains over its own
    data-parallel ranks) creates its side groups while the other parts create theirs at the same point
    of their own engines' construction, so each part's group is created by every rank, part after part,
    and a rank keeps its own part's.  ``ranks`` are the world's own numbering (None: all of them).
    """
    timeout = datetime.timedelta(seconds=world.timeout_s)
    if not world.parts:
        return dist.new_group(ranks=None if ranks is None else list(ranks), backend=backend, timeout=timeout)
    me, mine = dist.get_rank(), None
    for part in world.parts:
        members = [part[r] for r in (range(len(part)) if ranks is None else ranks)]
        group = dist.new_group(ranks=members, backend=backend, timeout=timeout)
        if me in members:
            mine = group
    return mine


class LocalRankError(RuntimeError):
    """``LOCAL_RANK`` names a CUDA device this host does not have (more processes per node than GPUs)."""


def _device_backends(backend_config: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``; a single name -> ``{}``."""
    pairs = [part.split(":", 1) for part in backend_config.lower().replace(" ", "").split(",") if part]
    return {pair[0]: pair[1] for pair in pairs if len(pair) == 2}


def runs_cuda_collectives(backend_config: str) -> bool:
    """Whether a process group of this backend configuration (``dist.get_backend_config()``: ``"nccl"``,
    ``"cuda:nccl"``, ``"cpu:gloo,cuda:nccl"``, ...) runs its CUDA collectives on a device backend (not
    gloo, which would stage them through host memory)."""
    named = _device_backends(backend_config)
    if not named:
        return backend_config.lower() == "nccl"
    return named.get("cuda", "gloo") != "gloo"


def choose_device(backend_config: str, cuda_available: bool, device_count: int, local_rank: int) -> torch.device:
    """[Note: which device a rank trains on]
    A rank trains on ``cuda:LOCAL_RANK`` whenever CUDA is available and its process group can run
    collectives on CUDA tensors with a device backend: a group whose backend is NCCL, and also one that
    maps CUDA to NCCL among others, as ``init_process_group()`` without a backend does
    (``cpu:gloo,cuda:nccl``, or ``cuda:nccl`` on a GPU host); deciding by the backend's name alone
    would train such a job silently on the CPU of a GPU host.  A gloo group (``init_process_group("gloo")``
    maps CUDA to gloo too, which stages every collective through host memory) trains on the CPU, as
    its user asked.  A ``LOCAL_RANK`` beyond the host's devices is refused here, with what to do,
    rather than by CUDA's "invalid device ordinal" at the first tensor.  ``backend_config`` is
    ``"none"`` for a lone process without a process group: it trains on the GPU when there is one.
    """
    wants_cuda = cuda_available and (backend_config == "none" or runs_cuda_collectives(backend_config))
    if not wants_cuda:
        return torch.device("cpu")
    check_local_rank(local_rank, device_count)
    return torch.device("cuda", local_rank)


def check_local_rank(local_rank: int, device_count: int) -> None:
    """Refuse a ``LOCAL_RANK`` that names no CUDA device of this host (see [Note: which device a rank
    trains on])."""
    if not 0 <= local_rank < device_count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise LocalRankError(
            f"LOCAL_RANK {local_rank} but this host has {device_count} CUDA device(s){shown}: launch at most "
            f"{device_count} process(es) per node (torchrun --nproc-per-node {device_count}), or set "
            f"CUDA_VISIBLE_DEVICES so that every local rank has a device of its own")


def _pick_backend() -> tuple[str, torch.device]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and dist.is_nccl_available():
        check_local_rank(local_rank, torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


_exit_callbacks: list[Callable[[], Optional[Callable[[], None]]]] = []  # weak references to bound methods
_last_exit_callbacks: list[Callable[[], Optional[Callable[[], None]]]] = []  # the same, called after those


def release_at_exit(method: Callable[[], None], *, last: bool = False) -> None:
    """Call ``method`` (a bound method, held weakly) at exit, before the process group is destroyed: it
    must finish this object's collectives and drop its references to process groups.  ``last``: after
    every other such method (what serves the others' collectives, which they may still be finishing)."""
    if not _exit_callbacks and not _last_exit_callbacks:
        atexit.register(_clean_exit)
    (_last_exit_callbacks if last else _exit_callbacks).append(weakref.WeakMethod(method))


def _clean_exit() -> None:
    """[Note: a clean exit]
    A process that reaches interpreter shutdown while Python objects still reference a gloo process
    group (its ``ProcessGroup`` object, a side group, an unfinished ``Work``) destroys the group's C++
    state during finalization, and in a good fraction of runs (with collectives issued from autograd
    hooks, as every ZeRO backward does) dies in ``terminate called without an active exception``
    (SIGABRT) after finishing its work: torchrun then reports a failed job.  Destroying the groups
    while the interpreter is intact, with nothing else holding them, does not abort.  So zeroshard
    keeps no reference to the default group (``World.group`` is None for it), and at exit each live
    engine finishes its collectives and drops its side groups, the rings' progress threads stop and
    let go of theirs (distributed/ring_progress.py), and torch's own hold on the default group is
    undone (``_unbind_groups_from_default_arguments``); then the process groups are destroyed, whoever
    created them (Hugging Face and Accelerate never destroy theirs), and gloo's threads are joined
    before the interpreter goes.  A group still held at shutdown is not harmless even when its work is
    done: a gloo thread drops its last finished collective a moment after the caller's ``wait()``
    returns, and when that collective's tensors were Python's (Accelerate's ``gather()`` ends a run
    so) the drop needs the GIL, which a finalizing interpreter refuses by ending the thread: the same
    abort.  How often each case aborts is counted in benchmarks/RESULTS.md, section "Reliability: the
    consistency check's cost and a soak run", paragraph "A clean exit"."""
    for ref in _exit_callbacks + _last_exit_callbacks:
        method = ref()
        if method is not None:
            method()
    _exit_callbacks.clear()
    _last_exit_callbacks.clear()
    if dist.is_available() and dist.is_initialized():
        _unbind_groups_from_default_arguments()
        dist.destroy_process_group()


def _unbind_groups_from_default_arguments() -> None:
    """torch.distributed.nn.functional's functions default to ``group=group.WORLD``, evaluated when
    the module is imported: imported after ``init_process_group`` (torch imports it when the first
    optimizer is built), they hold the default group for the process's life, and
    ``destroy_process_group`` cannot free it.  None names the same group to them."""
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None:  # never imported: nothing bound
        return
    for function in vars(module).values():
        defaults = function.__defaults__ if isinstance(function, types.FunctionType) else None
        if defaults and any(isinstance(value, dist.ProcessGroup) for value in defaults):
            function.__defaults__ = tuple(None if isinstance(value, dist.ProcessGroup) else value
                                          for value in defaults)


def _warn_if_restarts_share_a_store() -> None:
    """torchrun restarts whose workers meet in the agent's long-lived store can fail to connect
    (see [Note: restarts need a fresh store] in deepspeed/launcher.py): say how to avoid it."""
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if restarts.isdigit() and int(restarts) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" \
            and os.environ.get("RANK") == "0":
        logging.getLogger("zeroshard").warning(
            "torchrun --max-restarts with the agent's shared store: a restarted group can fail to connect "
            "(stale addresses of the dead workers, pytorch/pytorch#135712). Launch with `zeroshard run`, or with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and torchrun --standalone (one node) / --rdzv-backend c10d")


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                     init_method: Optional[str] = None, rank: int = -1, world_size: int = -1,
                     discover_launcher: bool = True, port: int = DEFAULT_PORT, must_exist: bool = False) -> World:
    """Join (or create) the default process group and describe it.

    - Already initialised (by the user or an earlier call): reuse it (a ``rank``/``world_size`` that
      contradicts it is refused).
    - Started by a launcher (torchrun; with ``discover_launcher``, also mpirun or srun: see
      [Note: launchers in torchrun's names] in distributed/launch_env.py), or given ``init_method``
      (``env://``, ``tcp://host:port``, ``file:///path``) or ``rank``/``world_size``: torch's
      ``init_process_group`` with them (see [Note: every launch meets through torch] in
      distributed/rendezvous.py), NCCL when CUDA is available, gloo otherwise; ``backend`` overrides
      the choice.  ``port``: the master's port when the launcher gives none.
    - A lone process: a world of size 1 without a process group (no collectives are ever issued).

    ``timeout_s`` bounds every collective, so a desynchronised job fails instead of hanging.
    ``must_exist`` (DeepSpeed's ``dist_init_required=False``): the group must already exist.
    """
    if must_exist and not dist.is_initialized():
        raise RuntimeError("dist_init_required=False but no process group exists: create it first "
                           "(init_distributed()), or pass dist_init_required=None")
    launch = discover(os.environ, port, mpi=discover_launcher)
    if launch is not None and launch.launcher != "torchrun":
        os.environ.update(launch.variables())
    if dist.is_initialized():
        check_joined(rank, world_size, dist.get_rank(), dist.get_world_size())
    else:
        meeting = plan(init_method, rank, world_size, launch)
        if meeting is not None:
            _warn_if_restarts_share_a_store()
            chosen, _ = _pick_backend()
            dist.init_process_group(backend=backend or chosen, init_method=meeting.init_method, rank=meeting.rank,
                                    world_size=meeting.world_size, timeout=datetime.timedelta(seconds=timeout_s))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda, count = torch.cuda.is_available(), torch.cuda.device_count()
    if not dist.is_initialized():
        device = choose_device("none", cuda, count, local_rank)
        return World(0, 1, 0, device, "none", None, timeout_s)
    config = dist.get_backend_config()
    device = choose_device(config, cuda, count, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return World(dist.get_rank(), dist.get_world_size(), local_rank, device, backend_for(config, device), None,
                 timeout_s)


def backend_for(backend_config: str, device: torch.device) -> str:
    """The backend that runs a group's collectives on ``device``'s tensors: ``"cuda:nccl"`` or
    ``"cpu:gloo,cuda:nccl"`` on ``cuda`` is ``"nccl"``, on ``cpu`` ``"gloo"``; a single name is itself."""
    named = _device_backends(backend_config)
    if not named:
        return backend_config.lower()
    return named.get(device.type, next(iter(named.values())))
