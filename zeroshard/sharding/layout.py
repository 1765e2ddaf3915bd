"""Where every trainable parameter lives: one flat buffer, cut into buckets, each bucket cut into N shards.

[Note: per-bucket sharding]
DeepSpeed gives each rank one contiguous slice of the whole flat buffer; a gradient bucket then
straddles the ranks' slices unevenly, and reducing it needs N separate reduces.  zeroshard instead
pads *each bucket* to a multiple of N elements and gives rank r the r-th equal chunk of every bucket.
A bucket is then exactly one ``reduce_scatter_tensor`` (and one ``all_gather_into_tensor`` after the
step), equal chunks, no special cases; a rank's shard is the list of its chunks, one per bucket.  The
cost is at most N-1 padding elements per bucket, reported as ``padding`` in the memory breakdown.

[Note: bucket order]
Parameters are laid out in reverse registration order, which is close to the order in which backward
produces their gradients, so buckets fill front to back and each can be reduced while backward goes on.
Buckets never span two optimizer parameter groups, so each chunk belongs to exactly one group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place inside its bucket."""

    index: int  # position in the engine's list of trainable parameters
    name: str
    offset: int  # element offset inside the bucket
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BucketLayout:
    """A contiguous run of the flat buffer that is communicated as one collective."""

    index: int
    group_index: int  # optimizer parameter group
    offset: int  # element offset of the bucket inside the flat buffer
    numel: int  # real elements
    padded_numel: int  # a multiple of world_size
    slots: tuple[ParamSlot, ...]
    world_size: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's chunk, relative to the bucket."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def real_numel_in_shard(self, rank: int) -> int:
        """How many of rank's chunk elements hold parameters (the rest is padding)."""
        start, end = self.shard_range(rank)
        return max(0, min(end, self.numel) - start)


@dataclass(frozen=True)
class FlatLayout:
    """The bucket plan for all trainable parameters of one dtype and device."""

    buckets: tuple[BucketLayout, ...]
    world_size: int

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:
        return sum(b.padded_numel for b in self.buckets)

    def shard_numel(self) -> int:
        return sum(b.shard_numel for b in self.buckets)

    def real_numel_in_shard(self, rank: int) -> int:
        return sum(b.real_numel_in_shard(rank) for b in self.buckets)

    def slot_of(self) -> dict[int, tuple[BucketLayout, ParamSlot]]:
        return {s.index: (b, s) for b in self.buckets for s in b.slots}


def plan_buckets(params: Sequence[torch.Tensor], names: Sequence[str], group_of: Sequence[int],
                 bucket_numel: int, world_size: int) -> FlatLayout:
    """Group parameters (in reverse order) into buckets of about ``bucket_numel`` elements.

    A parameter larger than ``bucket_numel`` gets a bucket of its own; a new bucket also starts
    whenever the optimizer group changes.
    """
    buckets: list[BucketLayout] = []
    pending: list[ParamSlot] = []
    pending_group = -1
    flat_offset = 0

    def close() -> None:
        nonlocal flat_offset, pending
        if not pending:
            return
        numel = pending[-1].offset + pending[-1].numel
        padded = -(-numel // world_size) * world_size
        buckets.append(BucketLayout(len(buckets), pending_group, flat_offset, numel, padded,
                                    tuple(pending), world_size))
        flat_offset += padded
        pending = []

    for index in reversed(range(len(params))):
        p = params[index]
        if pending and (group_of[index] != pending_group
                        or pending[-1].offset + pending[-1].numel >= bucket_numel):
            close()
        pending_group = group_of[index]
        offset = pending[-1].offset + pending[-1].numel if pending else 0
        pending.append(ParamSlot(index, names[index], offset, p.numel(), tuple(p.shape)))
    close()
    return FlatLayout(tuple(buckets), world_size)
