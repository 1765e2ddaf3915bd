"""The sequence-parallel groups of the live engine, which ``DistributedAttention`` exchanges over and
``deepspeed.utils.groups`` answers with, and the axes sequence parallelism combines with.

The engine builds the groups once from the job's axes (``ParallelDims.positions("sequence")``: blocks of
``sp`` consecutive positions of its ZeRO world, see [Note: the order of the axes] in
distributed/parallel_dims.py) and registers them here for as long as it lives.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..config.schema import SequenceParallelConfig
from ..distributed.collectives import Collectives
from ..distributed.parallel_dims import ParallelDims
from ..distributed.world import World
from .policy import ULYSSES, SequenceAttention

__all__ = ["SequenceParallelError", "SequenceGroups", "register_sequence_groups", "live_sequence_groups",
           "sequence_collectives", "sequence_attention", "check_sequence_axes"]


class SequenceParallelError(ValueError):
    """What sequence parallelism cannot run: attention heads that do not split over the sequence-parallel
    ranks, a tensor that does not split into equal parts, or an axis it does not combine with yet."""


@dataclass(frozen=True)
class SequenceGroups:
    """One engine's groups of sequence parallelism, as DeepSpeed's ``deepspeed.utils.groups`` names them."""

    #: the ranks that split each sequence (``sequence_parallel_size`` consecutive positions)
    sequence: Collectives
    #: the ranks ZeRO shards over and averages gradients over: data x sequence (the engine's world)
    sequence_data: Collectives
    #: how attention runs over the split sequences (the config's ``sequence_parallel`` block)
    attention: SequenceAttention = ULYSSES


class _Holder:
    """Keeps the groups registered for as long as its engine lives (the engine holds the holder)."""

    def __init__(self, groups: SequenceGroups) -> None:
        self.groups = groups


_live: list["weakref.ref[_Holder]"] = []


def register_sequence_groups(sequence: Optional[Collectives], zero: Collectives,
                             config: Optional[SequenceParallelConfig] = None) -> Optional[_Holder]:
    """Make an engine's groups, and the mode of attention its config's ``sequence_parallel`` block chose
    (Ulysses without one), the ones ``DistributedAttention`` and ``deepspeed.utils.groups`` use, until the
    returned holder (kept by the engine) goes; None (nothing registered) without a sequence axis."""
    if sequence is None:
        return None
    attention = ULYSSES if config is None else SequenceAttention.from_config(config)
    holder = _Holder(SequenceGroups(sequence, zero, attention))
    _live.append(weakref.ref(holder))
    return holder


def live_sequence_groups() -> Optional[SequenceGroups]:
    """The groups of the newest live engine with a sequence axis; None without one."""
    _live[:] = [ref for ref in _live if ref() is not None]
    holder = _live[-1]() if _live else None
    return holder.groups if holder is not None else None


def sequence_attention() -> SequenceAttention:
    """How ``DistributedAttention`` computes attention: as the live engine's config says (over the engine's
    group or a process group of the user's alike); Ulysses without an engine of a sequence axis."""
    live = live_sequence_groups()
    return ULYSSES if live is None else live.attention


def sequence_collectives(group: Any, device: torch.device) -> Optional[Collectives]:
    """The collectives a sequence-parallel layer exchanges over, for the ``sequence_process_group`` it was
    given: None, the live engine's sequence group (None without one: the sequence is not split); the
    process group of the live engine's sequence group, that group's collectives (counted in the engine's
    ledger); a ``Collectives``, itself; any other process group, collectives of its own over it."""
    live = live_sequence_groups()
    if group is None:
        return None if live is None else live.sequence
    if isinstance(group, Collectives):
        return group
    if live is not None and _same_ranks(group, live.sequence):
        return live.sequence
    world = World(rank=dist.get_rank(group), world_size=dist.get_world_size(group), local_rank=0, device=device,
                  backend=str(dist.get_backend(group)), group=group)
    return Collectives(world)


def _same_ranks(group: Any, comm: Collectives) -> bool:
    """Whether ``group`` holds the ranks of ``comm``'s group, in the same order (a group made before the
    engine, such as a sequence-parallel unit's, for the engine's own): the two then carry the same
    exchanges, and the engine's are counted in its ledger."""
    if group is comm.world.group:
        return True
    theirs = comm.world.group
    ranks = list(range(dist.get_world_size())) if theirs is None else dist.get_process_group_ranks(theirs)
    return dist.get_process_group_ranks(group) == ranks


def check_sequence_axes(axes: ParallelDims, *, model_parallel: bool = False) -> None:
    """Refuse, the same on every rank, the axes sequence parallelism does not combine with yet: pipeline
    stages, tensor parallelism (the config's or an mpu's) and expert parallelism."""
    if axes.sp == 1:
        return
    others = {"pipeline parallelism": axes.pp > 1, "tensor parallelism": axes.tp > 1 or model_parallel,
              "expert parallelism (MoE ep_size > 1)": axes.ep > 1}
    refused = [name for name, present in others.items() if present]
    if refused:
        raise SequenceParallelError(f"sequence_parallel_size = {axes.sp} with {' and '.join(refused)} is not "
                                    f"supported yet: sequence parallelism runs over data-parallel ranks alone")
