"""``deepspeed.utils.groups``: the process groups of the live engine's expert, sequence and data parallelism.

DeepSpeed's MoE code and scripts built on it ask this module for the groups by name (``ep_size_P``,
the name of an MoE layer's ``expert_group_name``).  zeroshard builds the groups once per engine, at
``initialize()`` (see [Note: experts sharded over the ranks that hold them] in experts/groups.py),
and the engine registers them here; before that, or for a name no engine built, the accessors raise
:class:`GroupsNotBuiltError`.  The sequence-parallel accessors answer from the live engine's axes
(``sequence_parallel_size``, zeroshard/sequence/groups.py): the group that splits each sequence, and the
group of data x sequence ranks ZeRO shards over; a job without a sequence axis answers as one of
``sequence_parallel_size`` 1, as DeepSpeed does.  ``initialize(ep_size=...)``, DeepSpeed's old way to make these groups,
raises as DeepSpeed's does: the size belongs to each ``MoE`` layer.  ``_get_expert_parallel_ranks``
answers, without any process group, which ranks a job of given sizes puts in each group.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from ...distributed.parallel_dims import ParallelDims
from ...experts.groups import ExpertGroupRecord, ExpertParallelError, live_expert_groups
from ...sequence.groups import live_sequence_groups


class GroupsNotBuiltError(RuntimeError):
    """An expert or data-parallel group asked for before ``initialize()`` built it."""


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """DeepSpeed's removed entry point, refused as DeepSpeed refuses it."""
    raise GroupsNotBuiltError("deepspeed.utils.groups.initialize() is deprecated in DeepSpeed and not provided: "
                              "pass ep_size to deepspeed.moe.layer.MoE(..., ep_size=...), and initialize() "
                              "builds the groups")


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1, use_data_before_expert_parallel_: bool = False
                               ) -> tuple[list[list[int]], list[list[int]]]:
    """Every expert-parallel group and every expert-data-parallel group of a job of ``world_size``
    ranks with these tensor, expert and pipeline sizes, as global ranks: the job's axes' expert groups
    (``ParallelDims.groups``), within each data-parallel group (one per pipeline stage and tensor index,
    ranks numbered as in [Note: the order of the axes] in distributed/parallel_dims.py)."""
    if use_data_before_expert_parallel_:
        raise ExpertParallelError("use_data_before_expert_parallel_=True (DeepSpeed's D + E layout) is not "
                                  "supported: zeroshard lays expert groups out as blocks of consecutive "
                                  "data-parallel ranks (E + D)")
    model_size = tensor_parallel_size_ * pipeline_parallel_size_
    if tensor_parallel_size_ < 1 or pipeline_parallel_size_ < 1 or world_size % model_size:
        raise ExpertParallelError(f"tensor_parallel_size_={tensor_parallel_size_} x pipeline_parallel_size_="
                                  f"{pipeline_parallel_size_} does not divide world_size={world_size}")
    if expert_parallel_size_ < 1 or (world_size // model_size) % expert_parallel_size_:
        raise ExpertParallelError(f"expert_parallel_size_={expert_parallel_size_} does not divide the "
                                  f"data-parallel size {world_size // model_size}")
    dims = ParallelDims(pp=pipeline_parallel_size_, dp=world_size // model_size, tp=tensor_parallel_size_,
                        ep=expert_parallel_size_)
    return [list(g) for g in dims.groups("expert")], [list(g) for g in dims.groups("expert_data")]


def _record(group_name: Optional[str] = None) -> ExpertGroupRecord:
    groups = live_expert_groups()
    if group_name is None and len(groups) == 1:
        return next(iter(groups.values()))
    if group_name not in groups:
        raise GroupsNotBuiltError(f"no expert group {group_name!r}: zeroshard.initialize() builds the groups of "
                                  f"the model's MoE layers (built now: {sorted(groups) or 'none'})")
    return groups[group_name]


def _group(group: Optional[dist.ProcessGroup]) -> Any:
    """The default group's handle where zeroshard holds none (a world over every rank)."""
    return group if group is not None else dist.group.WORLD


def _get_expert_parallel_group(group_name: str) -> Any:
    return _group(_record(group_name).exchange.world.group)


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {name: _group(r.exchange.world.group) for name, r in live_expert_groups().items()}


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return _group(_record(group_name).experts_data.world.group)


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return {name: _group(r.experts_data.world.group) for name, r in live_expert_groups().items()}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _record(group_name).exchange.world.world_size


def _get_expert_parallel_rank(group_name: str) -> int:
    return _record(group_name).exchange.world.rank


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _record(group_name).experts_data.world.world_size


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _record(group_name).experts_data.world.rank


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The global rank of the first rank of this rank's expert-parallel group."""
    record = _record(group_name)
    return dist.get_rank() - record.exchange.world.rank


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank of the first rank holding this rank's experts."""
    return dist.get_rank() % _get_expert_parallel_world_size(group_name)


def _get_data_parallel_group() -> Any:
    return _group(_record().data.world.group)


def _get_data_parallel_world_size() -> int:
    return _record().data.world.world_size


def _get_data_parallel_rank() -> int:
    return _record().data.world.rank


def _get_broadcast_src_rank() -> int:
    return 0


def _get_max_expert_size() -> int:
    """The largest ``ep_size`` among the groups built."""
    return max((r.exchange.world.world_size for r in live_expert_groups().values()), default=1)


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_world_group() -> Any:
    return dist.group.WORLD


def _get_sequence_parallel_group() -> Any:
    """The live engine's group of the ranks that split each sequence; None without a sequence axis."""
    groups = live_sequence_groups()
    return None if groups is None else _group(groups.sequence.world.group)


def _get_sequence_parallel_world_size() -> int:
    groups = live_sequence_groups()
    return 1 if groups is None else groups.sequence.world.world_size


def _get_sequence_parallel_rank() -> int:
    groups = live_sequence_groups()
    return 0 if groups is None else groups.sequence.world.rank


def _get_sequence_data_parallel_group() -> Any:
    """The ranks ZeRO shards over and averages gradients over: data x sequence (the engine's world)."""
    groups = live_sequence_groups()
    return dist.group.WORLD if groups is None else _group(groups.sequence_data.world.group)


def _get_sequence_data_parallel_world_size() -> int:
    groups = live_sequence_groups()
    return (dist.get_world_size() if dist.is_initialized() else 1) if groups is None \
        else groups.sequence_data.world.world_size


def _get_sequence_data_parallel_rank() -> int:
    groups = live_sequence_groups()
    return (dist.get_rank() if dist.is_initialized() else 0) if groups is None else groups.sequence_data.world.rank
