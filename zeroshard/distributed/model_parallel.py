"""A model-parallel unit (``mpu``) as DeepSpeed takes it: checked, and read into the worlds zeroshard
trains over.

A model that brings its own tensor-parallel layers (Megatron's column- and row-parallel linears)
also brings the object that made their process groups: the ``mpu``.  zeroshard reads three things
from it, once: the data-parallel group (the world ZeRO shards and averages over), the
tensor-parallel group with this rank's place in it (the gradient norm is summed over it), and the
data-parallel groups of every other rank (see [Note: every data-parallel group of the job]).

[Note: every data-parallel group of the job]
An engine over part of the job creates side groups of its own (its consistency check, its
asynchronous saves, hybrid sharding), and ``dist.new_group`` must be entered by every rank of the job
in the same order (see [Note: side groups of a partial world] in distributed/world.py): the engine's
world must list every data-parallel group, its own among them.  They are gathered from the ranks
(one all-gather at start-up) rather than derived from the sizes, because an mpu may number its axes
in another order than Megatron's; they must split the job into groups of one size, each rank in
exactly one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from .collectives import Collectives
from .parallel_dims import ParallelDims
from .world import World

#: what every mpu answers: the data-parallel axis
DATA_METHODS = ("get_data_parallel_rank", "get_data_parallel_world_size", "get_data_parallel_group")
#: the tensor axis under Megatron's newer names, or under DeepSpeed's older ones
TENSOR_METHODS = ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size",
                  "get_tensor_model_parallel_group")
MODEL_METHODS = ("get_model_parallel_rank", "get_model_parallel_world_size", "get_model_parallel_group")


class MpuProtocolError(ValueError):
    """``initialize(mpu=...)`` got an object that lacks methods an mpu must have."""


class MpuLayoutError(ValueError):
    """The mpu's groups do not split the job as tensor x data parallelism does."""


def check_mpu(mpu: Any) -> tuple[str, ...]:
    """The names of the tensor axis's three methods on ``mpu`` (Megatron's newer ones when it has them
    all, else DeepSpeed's ``get_model_parallel_*``); raises :class:`MpuProtocolError` naming every
    missing method."""
    def missing(names: tuple[str, ...]) -> list[str]:
        return [name for name in names if not callable(getattr(mpu, name, None))]

    lacking = missing(DATA_METHODS)
    tensor = TENSOR_METHODS if not missing(TENSOR_METHODS) else MODEL_METHODS
    lacking += missing(tensor)
    if lacking:
        raise MpuProtocolError(
            f"initialize(mpu=...): {type(mpu).__name__} lacks {', '.join(lacking)}; an mpu answers "
            f"{', '.join(DATA_METHODS)} and either {', '.join(TENSOR_METHODS)} or {', '.join(MODEL_METHODS)}")
    return tensor


@dataclass(frozen=True)
class ModelParallelWorlds:
    """This rank's place in a tensor x data parallel job, read from its mpu."""

    #: the job's axes (``initialize()`` replaces the mpu's sizes with the axes it builds); an mpu's own
    #: groups may number the ranks otherwise, so the engine takes only the data axis's cuts from them
    dims: ParallelDims
    #: the data-parallel world an engine trains over (with every data-parallel group as its parts)
    data_world: World
    #: this rank's index on the tensor axis
    tensor_rank: int
    #: the collectives over this rank's tensor-parallel group (the gradient norm's sum)
    tensor: Collectives


def model_parallel_worlds(mpu: Any, world: World) -> ModelParallelWorlds:
    """Read ``mpu`` (checked by :func:`check_mpu`) into the worlds of ``world``, the whole job; every
    rank calls it at the same point."""
    rank_name, size_name, group_name = check_mpu(mpu)
    tp, tensor_rank = int(getattr(mpu, size_name)()), int(getattr(mpu, rank_name)())
    dp, data_rank = int(mpu.get_data_parallel_world_size()), int(mpu.get_data_parallel_rank())
    if tp * dp != world.world_size:
        raise MpuLayoutError(f"the mpu says tensor parallel {tp} x data parallel {dp}, but the job has "
                             f"{world.world_size} ranks; pipeline or other model-parallel axes are not "
                             f"supported with a plain model")
    data_group: Optional[dist.ProcessGroup] = mpu.get_data_parallel_group()
    parts = _all_data_parallel_groups(data_group, world, dp)
    own = parts.index(next(p for p in parts if world.rank in p))
    if parts[own].index(world.rank) != data_rank:
        raise MpuLayoutError(f"the mpu says data-parallel rank {data_rank}, but rank {world.rank} is at "
                             f"{parts[own].index(world.rank)} in its data-parallel group {parts[own]}")
    data_world = dataclasses.replace(world, rank=data_rank, world_size=dp, group=data_group,
                                     parts=parts if len(parts) > 1 else ())
    tensor_world = dataclasses.replace(world, rank=tensor_rank, world_size=tp, group=getattr(mpu, group_name)(),
                                       parts=())
    return ModelParallelWorlds(ParallelDims(1, dp, tp), data_world, tensor_rank, Collectives(tensor_world))


def _all_data_parallel_groups(group: Optional[dist.ProcessGroup], world: World, dp: int
                              ) -> tuple[tuple[int, ...], ...]:
    """Every data-parallel group of the job, in the order of their first ranks (see [Note: every
    data-parallel group of the job])."""
    if not dist.is_initialized():
        return ((0,),)
    mine = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world.world_size))
    gathered: list[Any] = [None] * world.world_size
    dist.all_gather_object(gathered, mine, group=world.group)
    parts = sorted({tuple(ranks) for ranks in gathered}, key=lambda ranks: min(ranks))
    covered = sorted(r for part in parts for r in part)
    if covered != list(range(world.world_size)) or any(len(part) != dp for part in parts):
        raise MpuLayoutError(f"the mpu's data-parallel groups {parts} do not split the {world.world_size} "
                             f"ranks into groups of {dp}, each rank in one")
    return tuple(parts)
