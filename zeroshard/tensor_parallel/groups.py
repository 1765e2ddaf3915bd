"""The groups of a tensor x data parallel job zeroshard lays out itself (``tensor_parallel.autotp_size``).

Tensor-parallel ranks are neighbours (ranks ``d*T .. d*T+T-1``: one node's ranks when T divides the
ranks per node), data-parallel ranks every T-th one, as Megatron and DeepSpeed number them; both axes
are one torch ``DeviceMesh`` (``("data", "tensor")``), whose tensor axis DTensor computes over.  The
object answers the mpu protocol (``get_tensor_model_parallel_*``, ``get_data_parallel_*`` and DeepSpeed's
``get_model_parallel_*``), so the engine reads it exactly as it reads a Megatron model's own mpu
(distributed/model_parallel.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class TensorParallelSizeError(ValueError):
    """``autotp_size`` does not divide the job's ranks."""


class TensorParallelGroups:
    """A ``(data, tensor)`` mesh over every rank of the job, with the mpu's methods."""

    def __init__(self, size: int, device: torch.device) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world % size:
            raise TensorParallelSizeError(f"tensor_parallel.autotp_size = {size} does not divide the {world} "
                                          f"ranks of the job: choose a divisor of {world}")
        self.size, self.data_size = size, world // size
        self.mesh: DeviceMesh = init_device_mesh(device.type, (self.data_size, size), mesh_dim_names=("data", "tensor"))
        self.tensor_mesh: DeviceMesh = self.mesh["tensor"]
        self._rank = dist.get_rank() if dist.is_initialized() else 0

    def get_tensor_model_parallel_rank(self) -> int:
        return self._rank % self.size

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.size

    def get_tensor_model_parallel_group(self) -> Any:
        return self.tensor_mesh.get_group()

    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_group = get_tensor_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self._rank // self.size

    def get_data_parallel_world_size(self) -> int:
        return self.data_size

    def get_data_parallel_group(self) -> Any:
        return self.mesh["data"].get_group()
