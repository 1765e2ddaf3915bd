"""Every parallel axis of a job in one object: the sizes, where a rank sits on each axis, and the
process groups of each axis, built once.

[Note: the order of the axes]
Ranks are numbered with the pipeline axis outermost and the data axis innermost, as DeepSpeed's
``PipeDataParallelTopology`` numbers them: stage ``s`` holds ranks ``s*dp .. s*dp+dp-1``.  A stage's
data-parallel group carries ZeRO's traffic (gathers and reduce-scatters every step), so its ranks are
consecutive and share a node whenever ``dp`` divides the ranks per node; the pipeline axis carries one
activation and one gradient per micro-batch and stage, and is the one that crosses nodes.  Tensor and
expert parallelism are axes inside the data axis here (their traffic is heavier still): the tensor
axis (``tp``, Megatron's layers split across ranks) is the innermost, so a rank is numbered
``(stage*dp + data)*tp + tensor``, Megatron's own order.

Every rank creates every group of every axis, in the same order (``dist.new_group`` asks for that),
and a rank keeps its own.  The data-parallel world an inner engine trains over records every stage's
ranks (``World.parts``), so that the groups the engine creates for itself follow the same rule (see
[Note: side groups of a partial world] in distributed/world.py).
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Optional, Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .collectives import Collectives
from .world import World, release_at_exit


class StagesDoNotDivideError(ValueError):
    """The number of pipeline stages does not divide the number of ranks."""


@dataclass(frozen=True)
class ParallelDims:
    """The size of each parallel axis: ``pp`` pipeline stages x ``dp`` data-parallel ranks per stage x
    ``tp`` tensor-parallel ranks per data-parallel rank."""

    pp: int
    dp: int
    tp: int = 1

    def __post_init__(self) -> None:
        if self.pp < 1 or self.dp < 1 or self.tp < 1:
            raise ValueError(f"parallel sizes must be >= 1, got pp={self.pp}, dp={self.dp}, tp={self.tp}")

    @classmethod
    def for_world(cls, world_size: int, pp: int) -> "ParallelDims":
        """``pp`` stages over ``world_size`` ranks, the rest data parallel; refused unless ``pp`` divides it."""
        if pp < 1 or world_size % pp:
            raise StagesDoNotDivideError(
                f"num_stages={pp} does not divide the world size {world_size}: the ranks are split into "
                f"num_stages pipeline stages of equal data-parallel size; choose a divisor of {world_size}")
        return cls(pp, world_size // pp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def rank_of(self, stage: int, data: int, tensor: int = 0) -> int:
        """The global rank at pipeline ``stage``, data-parallel index ``data`` and tensor-parallel index
        ``tensor`` (see [Note: the order of the axes])."""
        return (stage * self.dp + data) * self.tp + tensor

    def coords(self, rank: int) -> tuple[int, int]:
        """``(stage, data)`` of a global rank."""
        return divmod(rank // self.tp, self.dp)

    def tensor_index(self, rank: int) -> int:
        """Where a global rank sits on the tensor axis."""
        return rank % self.tp

    def data_parallel_ranks(self, stage: int, tensor: int) -> tuple[int, ...]:
        """The ranks that hold the same shard of the model at ``stage`` and ``tensor`` and train it on
        different data: the data-parallel group ZeRO shards over."""
        return tuple(self.rank_of(stage, d, tensor) for d in range(self.dp))

    def pipeline_ranks(self, data: int, tensor: int = 0) -> tuple[int, ...]:
        """The pipeline (every stage, in order) of data-parallel index ``data`` and tensor index ``tensor``."""
        return tuple(self.rank_of(s, data, tensor) for s in range(self.pp))

    def pipelines(self) -> list[tuple[int, ...]]:
        """Every pipeline of the job, in the order of their first ranks (data-major, tensor-minor)."""
        return [self.pipeline_ranks(d, t) for d in range(self.dp) for t in range(self.tp)]


def _own_of(rank_lists: Sequence[Sequence[int]], mine: int, timeout_s: float) -> Optional[dist.ProcessGroup]:
    """Create a group for each list of ranks, in order; the one at index ``mine`` (-1: none) is returned."""
    own = None
    for index, ranks in enumerate(rank_lists):
        group = dist.new_group(ranks=list(ranks), timeout=datetime.timedelta(seconds=timeout_s))
        if index == mine:
            own = group
    return own


class ParallelGroups:
    """This rank's place on every axis and the groups it communicates over.

    - ``data_world``: the stage's data-parallel ranks, the world its ZeRO engine trains over;
    - ``pipe``: the stages of this rank's pipeline, for the collectives over the whole model (the
      gradient norm, the loss);
    - ``p2p``: the same ranks again, for the activations and gradients between neighbouring stages,
      a group of its own so that they never queue behind a collective;
    - :meth:`subpipeline`: a group of some stages of this pipeline (a tied weight's stages);
    - with tensor parallelism (``dims.tp > 1``), ``tensor``: this rank's tensor-parallel group, and
      ``tensor_mesh``: the same ranks as the torch ``DeviceMesh`` DTensor computes over.  Each
      (stage, tensor index) then has its own data-parallel group, and each (data, tensor index) its
      own pipeline.
    """

    def __init__(self, dims: ParallelDims, world: World) -> None:
        if dims.world_size != world.world_size:
            raise StagesDoNotDivideError(f"{dims} covers {dims.world_size} ranks, the world has {world.world_size}")
        self.dims = dims
        self.world = world
        self.stage, self.data = dims.coords(world.rank)
        self.tensor_index = dims.tensor_index(world.rank)
        parts = tuple(dims.data_parallel_ranks(s, t) for s in range(dims.pp) for t in range(dims.tp))
        timeout = world.timeout_s
        # one data-parallel group for the whole job: the default group
        split = len(parts) > 1 and dims.dp > 1
        data_group = _own_of(parts, self.stage * dims.tp + self.tensor_index, timeout) if split else None
        self.data_world = dataclasses.replace(world, rank=self.data, world_size=dims.dp, group=data_group,
                                              parts=parts if split else ())
        #: this rank's pipeline's index among ``dims.pipelines()``
        self._pipeline = self.data * dims.tp + self.tensor_index
        pipelines = dims.pipelines() if dims.pp > 1 and dims.dp * dims.tp > 1 else []
        pipe_group = _own_of(pipelines, self._pipeline, timeout)  # None: one pipeline, the default group
        self.pipe = Collectives(dataclasses.replace(world, rank=self.stage, world_size=dims.pp, group=pipe_group))
        #: the group of point-to-point messages between stages (None: no neighbours)
        self.p2p = _own_of(dims.pipelines() if dims.pp > 1 else [], self._pipeline, timeout)
        self.tensor_mesh: Optional[DeviceMesh] = None
        self.tensor: Optional[Collectives] = None
        #: with tensor parallelism, the ranks of this rank's tensor index, numbered ``stage * dp + data``:
        #: a tensor-parallel job's part of a checkpoint is theirs (pipeline/checkpoint.py)
        self.tensor_slice: Optional[World] = None
        if dims.tp > 1:  # ranks numbered (stage * dp + data) * tp + tensor: one mesh row per tensor group
            self.tensor_mesh = init_device_mesh(world.device.type, (dims.pp * dims.dp, dims.tp),
                                                mesh_dim_names=("replica", "tensor"))["tensor"]
            self.tensor = Collectives(dataclasses.replace(world, rank=self.tensor_index, world_size=dims.tp,
                                                          group=self.tensor_mesh.get_group(), parts=()))
            slices = [[dims.rank_of(s, d, t) for s in range(dims.pp) for d in range(dims.dp)] for t in range(dims.tp)]
            self.tensor_slice = dataclasses.replace(
                world, rank=self.stage * dims.dp + self.data, world_size=dims.pp * dims.dp,
                group=_own_of(slices, self.tensor_index, timeout), parts=())
        #: the gradients' own point-to-point group, with virtual stages (:meth:`gradient_p2p`)
        self.p2p_gradients: Optional[dist.ProcessGroup] = None
        self._subgroups: dict[tuple[int, ...], Optional[dist.ProcessGroup]] = {}
        release_at_exit(self.release)

    def gradient_p2p(self) -> Optional[dist.ProcessGroup]:
        """A second point-to-point group over the same pipelines, for the gradients going backward, created
        once (every rank calls it): with virtual stages two neighbours exchange activations and gradients
        in both directions (see [Note: a header before every activation] in pipeline/p2p.py)."""
        if self.p2p_gradients is None and self.dims.pp > 1:
            self.p2p_gradients = _own_of(self.dims.pipelines(), self._pipeline, self.world.timeout_s)
        return self.p2p_gradients

    def describe(self) -> str:
        """The job's layout, the same on every rank: each axis's size and which ranks form its groups."""
        dims = self.dims
        tensor = [list(range(r, r + dims.tp)) for r in range(0, dims.world_size, dims.tp)]
        data = [list(dims.data_parallel_ranks(s, t)) for s in range(dims.pp) for t in range(dims.tp)]
        return (f"pipeline {dims.pp} x data {dims.dp} x tensor {dims.tp} over {dims.world_size} ranks, numbered "
                f"(stage * {dims.dp} + data) * {dims.tp} + tensor: tensor-parallel groups {tensor}, data-parallel "
                f"groups {data}, pipelines {[list(p) for p in dims.pipelines()]}")

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.dims.pp - 1

    def subpipeline(self, stages: Sequence[int]) -> Optional[dist.ProcessGroup]:
        """A group of ``stages`` (ascending) of this rank's pipeline, created once for every pipeline;
        None unless this rank is in it.  Every rank asks for the same stages in the same order."""
        key = tuple(stages)
        if key not in self._subgroups:
            lists = [[pipeline[s] for s in key] for pipeline in self.dims.pipelines()]
            self._subgroups[key] = _own_of(lists, self._pipeline if self.stage in key else -1, self.world.timeout_s)
        return self._subgroups[key]

    def release(self) -> None:
        """Drop the references to the groups (at exit, before the process groups are destroyed)."""
        self.pipe.world = dataclasses.replace(self.pipe.world, group=None)
        self.p2p = self.p2p_gradients = None
        if self.tensor is not None:
            self.tensor.world = dataclasses.replace(self.tensor.world, group=None)
        if self.tensor_slice is not None:
            self.tensor_slice = dataclasses.replace(self.tensor_slice, group=None)
        self.data_world = dataclasses.replace(self.data_world, group=None)
        self._subgroups.clear()
