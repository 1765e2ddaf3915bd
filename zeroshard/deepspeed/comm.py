"""``deepspeed.comm``: the process-group calls DeepSpeed scripts make, on torch.distributed.

``init_distributed`` joins the job's process group, however it was launched (torchrun, mpirun, srun,
``tcp://``/``file://``), through zeroshard's own
:func:`~zeroshard.distributed.world.init_distributed` (gloo on CPU, NCCL on CUDA); the collectives
are torch.distributed's, on the default group, for user code (zeroshard's engine issues its own
through its labelled, byte-counting layer).
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..distributed.collectives import all_gather_1d, reduce_scatter_1d
from ..distributed.launch_env import DEFAULT_PORT
from ..distributed.world import DEFAULT_TIMEOUT_S, World
from ..distributed.world import init_distributed as _join

ReduceOp = dist.ReduceOp

__all__ = ["init_distributed", "is_initialized", "get_rank", "get_world_size", "get_local_rank", "barrier",
           "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
           "ReduceOp", "destroy_process_group"]


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout: Optional[datetime.timedelta] = None, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> World:
    """Join the job's process group (DeepSpeed's signature; returns zeroshard's :class:`World`).

    However the job was launched: torchrun's variables; without them (``auto_mpi_discovery``) mpirun's
    (OpenMPI, MPICH, Intel MPI) or srun's, with ``distributed_port`` as the master's port when
    ``MASTER_PORT`` is unset; or ``init_method`` (``env://``, ``tcp://host:port``, ``file:///path``) with
    ``rank`` and ``world_size``, all handed to torch's ``init_process_group``.  ``dist_backend`` picks
    gloo/nccl, ``timeout`` bounds every collective.  ``dist_init_required=False``: a process group must
    already exist.  A rank without a world size, or either contradicting the launcher's, raises
    :class:`~zeroshard.distributed.launch_env.LaunchError`.  ``verbose`` and ``config`` change nothing.
    """
    del verbose, config
    seconds = timeout.total_seconds() if timeout is not None else DEFAULT_TIMEOUT_S
    return _join(backend=dist_backend, timeout_s=seconds, init_method=init_method, rank=rank, world_size=world_size,
                 discover_launcher=auto_mpi_discovery, port=distributed_port,
                 must_exist=dist_init_required is False)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """torchrun's ``LOCAL_RANK`` (which ``init_distributed`` also sets under mpirun and srun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group: Any = None) -> None:
    if is_initialized():
        dist.barrier(group)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    if is_initialized():
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return None


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    if is_initialized():
        return dist.broadcast(tensor, src, group=group, async_op=async_op)
    return None


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Any:
    if is_initialized():
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)
    return None


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Any:
    if is_initialized():
        return all_gather_1d(output_tensor, tensor, group=group, async_op=async_op)
    output_tensor.copy_(tensor.reshape(output_tensor.shape))
    return None


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False) -> Any:
    if is_initialized():
        return reduce_scatter_1d(output_tensor, tensor, op=op, group=group, async_op=async_op)
    output_tensor.copy_(tensor.reshape(output_tensor.shape))
    return None


def destroy_process_group(group: Any = None) -> None:
    if is_initialized():
        dist.destroy_process_group(group)
