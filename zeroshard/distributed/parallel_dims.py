"""Every parallel axis of a job in one object: the sizes, where a rank sits on each axis, the ranks of
every group of every axis, and the process groups of each axis, built once.

:class:`ParallelDims` is pure arithmetic (no process group): ``initialize()`` builds it once from the
config, the topology and the mpu (:meth:`ParallelDims.for_job`), validated there, and hands it to the
engine; :class:`ParallelGroups`, the engine's hybrid-sharding and expert groups
(distributed/topology.py: ``build_shard_groups``), the tensor-parallel mesh (:func:`tensor_device_mesh`)
and the scale model (planning/) all take their rank lists from its :meth:`~ParallelDims.groups` and
:meth:`~ParallelDims.positions`, so the rank order is decided here alone.

[Note: the order of the axes]
Ranks are numbered with the pipeline axis outermost and the tensor axis innermost, as DeepSpeed's
``PipeModelDataParallelTopology`` and Megatron number them, the sequence axis between the data and
the tensor axes (torchtitan's place for its context axis):

    rank = ((stage * dp + data) * sp + seq) * tp + tensor

The heavier an axis's traffic, the further in it sits, so that its groups are consecutive ranks and
share a node first.  The tensor axis (``tp``, Megatron's layers split across ranks) exchanges
activations inside every layer.  The sequence axis (``sp``, DeepSpeed-Ulysses: each rank of a group
holds a slice of every sequence) exchanges activations at every attention layer.  The data axis
(``dp``) carries ZeRO's gathers and reduce-scatters every step.  The pipeline axis carries one
activation and one gradient per micro-batch and stage, and is the one that crosses nodes: stage ``s``
holds ranks ``s*dp*sp*tp ..``.

The ranks of a sequence group hold the same parameters and see different tokens, so ZeRO shards over
the data and sequence axes together, as DeepSpeed-Ulysses and torchtitan shard over them: the *ZeRO
world* of a stage and tensor index is its ``dp * sp`` ranks, at *positions* ``data * sp + seq``, the
world an engine trains over.  Every group ZeRO adds lies inside it, cut from its positions:

- MiCS (``dp_replicate`` > 1): shard groups of ``dp_shard * sp`` consecutive positions
  (``dp_shard = dp / dp_replicate``), and replica groups of the positions alike in every shard group:
  torchtitan's ``dp_replicate x dp_shard``;
- hpZ (``hpz`` > 1): secondary partitions of ``hpz`` consecutive positions;
- expert parallelism (``ep`` > 1): expert-parallel blocks of ``ep`` consecutive positions and
  expert-data-parallel groups of the positions alike in every block (see [Note: experts sharded over
  the ranks that hold them] in experts/groups.py).

Consecutive positions are consecutive ranks while ``tp`` is 1, and share a node whenever the group
divides the ranks per node.  Every rank creates every group of every axis, in the same order
(``dist.new_group`` asks for that): the groups of one kind part by part, stage-major then tensor
index, and a rank keeps its own.  The data-parallel world an inner engine trains over records every
part's ranks (``World.parts``), so that the groups the engine creates for itself follow the same rule
(see [Note: side groups of a partial world] in distributed/world.py).
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .collectives import Collectives
from .world import World, release_at_exit


class StagesDoNotDivideError(ValueError):
    """The number of pipeline stages does not divide the number of ranks."""


class TensorParallelSizeError(ValueError):
    """``autotp_size`` does not divide the job's ranks."""


class SequenceParallelSizeError(ValueError):
    """The sequence-parallel size does not divide the ranks left by the other axes."""


class HybridShardingError(ValueError):
    """A MiCS or hpZ group size (``mics_shard_size``, ``zero_hpz_partition_size``) the data axis cannot
    be cut into."""


class ExpertParallelError(ValueError):
    """An expert-parallel size the job cannot use: not dividing the world or the experts, several sizes
    in one model, or a feature expert parallelism does not combine with."""


#: the kinds of group :meth:`ParallelDims.groups` lists; those after "tensor" lie inside a ZeRO world
#: and are also :meth:`ParallelDims.positions`
GROUP_KINDS = ("pipeline", "tensor", "zero", "data", "sequence", "shard", "replicate", "secondary", "expert",
               "expert_data")


class Coords(NamedTuple):
    """Where a rank sits on each axis."""

    stage: int
    data: int
    tensor: int
    seq: int = 0


def consecutive_blocks(n: int, size: int) -> list[tuple[int, ...]]:
    """Blocks of ``size`` consecutive positions of ``n``."""
    return [tuple(range(start, start + size)) for start in range(0, n, size)]


def strided_groups(n: int, size: int) -> list[tuple[int, ...]]:
    """The positions of ``n`` at the same place in every block of ``size``."""
    return [tuple(range(position, n, size)) for position in range(size)]


@dataclass(frozen=True)
class ParallelDims:
    """The size of each parallel axis: ``pp`` pipeline stages x ``dp`` data-parallel ranks x ``sp``
    sequence-parallel ranks x ``tp`` tensor-parallel ranks, and how ZeRO cuts its world of ``dp * sp``
    ranks: ``dp_replicate`` MiCS replicas (each sharded over ``dp / dp_replicate`` data-parallel ranks),
    hpZ's secondary partition of ``hpz`` ranks, and ``ep`` expert-parallel ranks (see [Note: the order
    of the axes]).  Pure arithmetic: no process group."""

    pp: int
    dp: int
    tp: int = 1
    #: MiCS: how many copies of the sharded state the data axis holds (1: sharded over all of it)
    dp_replicate: int = 1
    #: hpZ: the ranks of a secondary partition (1: none)
    hpz: int = 1
    #: expert parallelism: the ranks of an expert-parallel group (1: none)
    ep: int = 1
    #: sequence parallelism: the ranks that split each sequence (1: none)
    sp: int = 1

    def __post_init__(self) -> None:
        sizes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if any(size < 1 for size in sizes.values()):
            shown = ", ".join(f"{name}={size}" for name, size in sizes.items())
            raise ValueError(f"parallel sizes must be >= 1, got {shown}")
        if self.dp % self.dp_replicate:
            raise HybridShardingError(f"dp_replicate={self.dp_replicate} does not divide the data axis's "
                                      f"{self.dp} ranks")
        if self.zero_size % self.hpz:
            raise HybridShardingError(f"hpz={self.hpz} does not divide the {self.zero_size} ranks ZeRO shards over")
        if self.hpz > 1 and self.dp_replicate > 1:
            raise HybridShardingError("MiCS (dp_replicate > 1) and hpZ (hpz > 1) together: choose one")
        if self.zero_size % self.ep:
            raise ExpertParallelError(f"MoE(ep_size={self.ep}) does not divide the data-parallel world of "
                                      f"{self.zero_size} ranks: choose an ep_size that divides it")

    @classmethod
    def for_world(cls, world_size: int, pp: int) -> "ParallelDims":
        """``pp`` stages over ``world_size`` ranks, the rest data parallel; refused unless ``pp`` divides it."""
        if pp < 1 or world_size % pp:
            raise StagesDoNotDivideError(
                f"num_stages={pp} does not divide the world size {world_size}: the ranks are split into "
                f"num_stages pipeline stages of equal data-parallel size; choose a divisor of {world_size}")
        return cls(pp, world_size // pp)

    @classmethod
    def for_job(cls, world_size: int, *, pp: int = 1, tp: int = 1, sp: int = 1, mics_shard_size: int = -1,
                hpz_partition_size: int = 1, ep: int = 1) -> "ParallelDims":
        """The axes of a job of ``world_size`` ranks from the config's sizes (``mics_shard_size`` -1 and
        ``zero_hpz_partition_size`` 1: off, a size of the whole ZeRO world: the same) and the model's
        MoE layers' ``ep_size``; each size that does not divide what it cuts is refused by name, the
        same on every rank."""
        base = cls.for_world(world_size, pp)
        if tp < 1 or base.dp % tp:
            raise TensorParallelSizeError(f"tensor_parallel.autotp_size = {tp} does not divide the {base.dp} "
                                          f"ranks of the job: choose a divisor of {base.dp}")
        if sp < 1 or base.dp // tp % sp:
            raise SequenceParallelSizeError(f"sequence_parallel_size = {sp} does not divide the {base.dp // tp} "
                                            f"ranks left by pipeline {pp} x tensor {tp}: choose a divisor of "
                                            f"{base.dp // tp}")
        zero = base.dp // tp
        for key, size in (("mics_shard_size", mics_shard_size), ("zero_hpz_partition_size", hpz_partition_size)):
            if size > 1 and zero % size:
                raise HybridShardingError(f"zero_optimization.{key} = {size} does not divide the world size {zero}: "
                                          f"choose a divisor of {zero}, usually the number of ranks per node")
        if 0 < mics_shard_size < zero and mics_shard_size % sp:
            raise HybridShardingError(f"zero_optimization.mics_shard_size = {mics_shard_size} is not a multiple "
                                      f"of the sequence-parallel size {sp}: a shard group holds whole sequences")
        replicate = zero // mics_shard_size if 0 < mics_shard_size < zero else 1
        hpz = hpz_partition_size if 1 < hpz_partition_size < zero else 1
        return cls(pp, zero // sp, tp, dp_replicate=replicate, hpz=hpz, ep=max(ep, 1), sp=sp)

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.sp * self.tp

    @property
    def zero_size(self) -> int:
        """The ranks of one ZeRO world: the data and sequence axes of a stage and tensor index."""
        return self.dp * self.sp

    @property
    def dp_shard(self) -> int:
        """The data-parallel ranks of a MiCS shard group (``dp`` without MiCS)."""
        return self.dp // self.dp_replicate

    # ------------------------------------------------------------------ the rank rule
    def rank_of(self, stage: int, data: int, tensor: int = 0, seq: int = 0) -> int:
        """The global rank at pipeline ``stage``, data-parallel index ``data``, tensor-parallel index
        ``tensor`` and sequence-parallel index ``seq`` (see [Note: the order of the axes])."""
        return ((stage * self.dp + data) * self.sp + seq) * self.tp + tensor

    def coords(self, rank: int) -> Coords:
        """Where a global rank sits on each axis (:meth:`rank_of`'s inverse)."""
        rest, tensor = divmod(rank, self.tp)
        rest, seq = divmod(rest, self.sp)
        stage, data = divmod(rest, self.dp)
        return Coords(stage, data, tensor, seq)

    def tensor_index(self, rank: int) -> int:
        """Where a global rank sits on the tensor axis."""
        return self.coords(rank).tensor

    def zero_position(self, rank: int) -> int:
        """A global rank's position in its ZeRO world (``data * sp + seq``)."""
        where = self.coords(rank)
        return where.data * self.sp + where.seq

    def rank_at(self, stage: int, tensor: int, position: int) -> int:
        """The global rank at ``position`` of the ZeRO world of ``stage`` and ``tensor``."""
        data, seq = divmod(position, self.sp)
        return self.rank_of(stage, data, tensor, seq)

    # ------------------------------------------------------------------ groups
    def positions(self, kind: str) -> list[tuple[int, ...]]:
        """The groups of ``kind`` inside one ZeRO world, as positions ``0 .. zero_size-1`` (the numbering
        of the world an engine trains over): ``zero`` (all of it), ``data`` (the ranks alike but for
        the data index), ``sequence``, MiCS's ``shard`` and ``replicate``, hpZ's ``secondary``,
        ``expert`` and ``expert_data``; each list partitions the world."""
        n = self.zero_size
        blocks = {"zero": n, "shard": n // self.dp_replicate, "secondary": self.hpz, "expert": self.ep,
                  "sequence": self.sp}
        strides = {"replicate": n // self.dp_replicate, "expert_data": self.ep, "data": self.sp}
        if kind in blocks:
            return consecutive_blocks(n, blocks[kind])
        if kind in strides:
            return strided_groups(n, strides[kind])
        raise ValueError(f"no group kind {kind!r} inside the ZeRO world; one of {GROUP_KINDS[2:]}")

    def groups(self, kind: str) -> list[tuple[int, ...]]:
        """Every group of ``kind`` (one of :data:`GROUP_KINDS`) of the job, as global ranks, in the order
        every rank creates them: ``pipeline`` by (data, sequence, tensor) index, ``tensor`` in rank
        order, the kinds inside a ZeRO world part by part, stage-major then tensor index."""
        if kind == "pipeline":
            return [tuple(self.rank_of(s, d, t, q) for s in range(self.pp))
                    for d in range(self.dp) for q in range(self.sp) for t in range(self.tp)]
        if kind == "tensor":
            return [tuple(self.rank_of(s, d, t, q) for t in range(self.tp))
                    for s in range(self.pp) for d in range(self.dp) for q in range(self.sp)]
        inside = self.positions(kind)
        return [tuple(self.rank_at(stage, tensor, p) for p in group)
                for stage in range(self.pp) for tensor in range(self.tp) for group in inside]

    def group_of(self, kind: str, rank: int) -> tuple[int, tuple[int, ...]]:
        """The index among :meth:`groups` of the group of ``kind`` that holds ``rank``, and its ranks."""
        return next((index, group) for index, group in enumerate(self.groups(kind)) if rank in group)

    def data_parallel_ranks(self, stage: int, tensor: int) -> tuple[int, ...]:
        """The ranks that hold the same shard of the model at ``stage`` and ``tensor`` and train it on
        different data (the ZeRO world ZeRO shards over)."""
        return tuple(self.rank_at(stage, tensor, p) for p in range(self.zero_size))

    def pipeline_ranks(self, data: int, tensor: int = 0) -> tuple[int, ...]:
        """The pipeline (every stage, in order) of data-parallel index ``data`` and tensor index ``tensor``."""
        return tuple(self.rank_of(s, data, tensor) for s in range(self.pp))

    def pipelines(self) -> list[tuple[int, ...]]:
        """Every pipeline of the job, in the order of their first ranks (data-major, tensor-minor)."""
        return self.groups("pipeline")

    def describe(self) -> str:
        """The sizes, as a log line says them."""
        extra = "".join(f" x {name} {size}" for name, size in (("sequence", self.sp), ("expert", self.ep),
                                                               ("MiCS replicas", self.dp_replicate),
                                                               ("hpZ", self.hpz)) if size > 1)
        return f"pipeline {self.pp} x data {self.dp} x tensor {self.tp}{extra}"


def tensor_device_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The torch ``DeviceMesh`` of the tensor axis, every rank calling it: one row per tensor-parallel
    group (``"tensor"``, which DTensor computes over) and the ranks of one tensor index in each column
    (``"replica"``, every other axis; the data-parallel group when the job has no pipeline or sequence
    axis)."""
    rows = torch.tensor(dims.groups("tensor"), dtype=torch.int64)
    return DeviceMesh(device_type, rows, mesh_dim_names=("replica", "tensor"))


def _own_of(rank_lists: Sequence[Sequence[int]], mine: int, timeout_s: float) -> Optional[dist.ProcessGroup]:
    """Create a group for each list of ranks, in order; the one at index ``mine`` (-1: none) is returned."""
    own = None
    for index, ranks in enumerate(rank_lists):
        group = dist.new_group(ranks=list(ranks), timeout=datetime.timedelta(seconds=timeout_s))
        if index == mine:
            own = group
    return own


class ParallelGroups:
    """This rank's place on every axis and the groups it communicates over, each made once from the
    rank lists of ``dims`` (:meth:`ParallelDims.groups`).

    - ``data_world``: the stage's ZeRO world (its data-parallel ranks), the world its engine trains over;
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
        where = dims.coords(world.rank)
        self.stage, self.data, self.tensor_index = where.stage, where.data, where.tensor
        parts = tuple(dims.groups("zero"))
        own_part, _ = dims.group_of("zero", world.rank)
        timeout = world.timeout_s
        # one data-parallel group for the whole job: the default group
        split = len(parts) > 1 and dims.zero_size > 1
        data_group = _own_of(parts, own_part, timeout) if split else None
        self.data_world = dataclasses.replace(world, rank=dims.zero_position(world.rank), world_size=dims.zero_size,
                                              group=data_group, parts=parts if split else ())
        #: this rank's pipeline's index among ``dims.pipelines()``
        self._pipeline, _ = dims.group_of("pipeline", world.rank)
        pipelines = dims.pipelines() if dims.pp > 1 and dims.world_size > dims.pp else []
        pipe_group = _own_of(pipelines, self._pipeline, timeout)  # None: one pipeline, the default group
        self.pipe = Collectives(dataclasses.replace(world, rank=self.stage, world_size=dims.pp, group=pipe_group))
        #: the group of point-to-point messages between stages (None: no neighbours)
        self.p2p = _own_of(dims.pipelines() if dims.pp > 1 else [], self._pipeline, timeout)
        self.tensor_mesh: Optional[DeviceMesh] = None
        self.tensor: Optional[Collectives] = None
        #: with tensor parallelism, the ranks of this rank's tensor index, numbered ``stage * dp + data``:
        #: a tensor-parallel job's part of a checkpoint is theirs (pipeline/checkpoint.py)
        self.tensor_slice: Optional[World] = None
        if dims.tp > 1:
            self.tensor_mesh = tensor_device_mesh(dims, world.device.type)["tensor"]
            self.tensor = Collectives(dataclasses.replace(world, rank=self.tensor_index, world_size=dims.tp,
                                                          group=self.tensor_mesh.get_group(), parts=()))
            rows = dims.groups("tensor")
            slices = list(zip(*rows))  # the mesh's columns: one tensor index, every row
            row, _ = dims.group_of("tensor", world.rank)
            self.tensor_slice = dataclasses.replace(world, rank=row, world_size=len(rows),
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
        return (f"pipeline {dims.pp} x data {dims.dp} x tensor {dims.tp} over {dims.world_size} ranks, numbered "
                f"(stage * {dims.dp} + data) * {dims.tp} + tensor: tensor-parallel groups "
                f"{[list(g) for g in dims.groups('tensor')]}, data-parallel groups "
                f"{[list(g) for g in dims.groups('zero')]}, pipelines {[list(p) for p in dims.pipelines()]}")

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
