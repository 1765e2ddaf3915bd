"""The groups of a tensor x data parallel job zeroshard lays out itself (``tensor_parallel.autotp_size``).

Tensor-parallel ranks are neighbours (ranks ``d*T .. d*T+T-1``: one node's ranks when T divides the
ranks per node), data-parallel ranks every T-th one, as the job's axes number them ([Note: the order of
the axes] in distributed/parallel_dims.py); both axes are one torch ``DeviceMesh`` made from the axes'
rank lists (``tensor_device_mesh``), whose tensor axis DTensor computes over.  The object answers the
mpu protocol (``get_tensor_model_parallel_*``, ``get_data_parallel_*`` and DeepSpeed's
``get_model_parallel_*``), so the engine reads it exactly as it reads a Megatron model's own mpu
(distributed/model_parallel.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..distributed.parallel_dims import ParallelDims, TensorParallelSizeError, tensor_device_mesh

__all__ = ["TensorParallelGroups", "TensorParallelSizeError"]


class TensorParallelGroups:
    """The ``(data, tensor)`` mesh of the job's axes ``dims`` (no pipeline), seen from global rank
    ``rank``, with the mpu's methods."""

    def __init__(self, dims: ParallelDims, rank: int, device: torch.device) -> None:
        if dims.pp > 1 or dims.sp > 1:  # a pipeline's stages are split over its own ParallelGroups
            raise ValueError(f"TensorParallelGroups over {dims.describe()}: tensor x data axes only")
        self.dims = dims
        self.size, self.data_size = dims.tp, dims.dp
        #: dimensions ``("replica", "tensor")``: the replica dimension is the data axis here
        self.mesh: DeviceMesh = tensor_device_mesh(dims, device.type)
        self.tensor_mesh: DeviceMesh = self.mesh["tensor"]
        self._where = dims.coords(rank)

    def get_tensor_model_parallel_rank(self) -> int:
        return self._where.tensor

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.size

    def get_tensor_model_parallel_group(self) -> Any:
        return self.tensor_mesh.get_group()

    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_group = get_tensor_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self._where.data

    def get_data_parallel_world_size(self) -> int:
        return self.data_size

    def get_data_parallel_group(self) -> Any:
        return self.mesh["replica"].get_group()
