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
from typing import Callable, Collection, Hashable, Iterable, Optional, Sequence

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
    #: stage 3: a bucket of frozen parameters, sharded and gathered like the others but never reduced
    #: or updated (the strategy and the optimizer see only the trainable buckets, which come first)
    frozen: bool = False
    #: a bucket of experts' parameters (expert parallelism): sharded over the ranks that hold the same
    #: experts, ``world_size`` of them (see [Note: experts sharded over the ranks that hold them] in
    #: experts/groups.py)
    experts: bool = False

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

    def chunk_start(self, chunk_numel: int, rank: int) -> int:
        """Where rank's owned chunk of ``chunk_numel`` elements starts (stage 0 owns the whole bucket)."""
        return 0 if chunk_numel == self.padded_numel else rank * chunk_numel

    def zero_unwritten(self, values: torch.Tensor, written: Collection[int], start: int = 0) -> None:
        """Zero the slots of ``values`` (elements ``[start, start + values.numel())`` of this bucket) whose
        parameter index is not in ``written``, and the padding: what a bucket must hold there before
        it is reduced."""
        end = start + values.numel()
        for slot in self.slots:
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if slot.index not in written and lo < hi:
                values[lo - start: hi - start].zero_()
        if self.numel < end:
            values[max(self.numel, start) - start:].zero_()

    def fill_chunk(self, start: int, into: torch.Tensor, read: Callable[[ParamSlot, int, int], Optional[torch.Tensor]]) -> None:
        """Copy into ``into`` (elements ``[start, start + into.numel())`` of this bucket) every parameter
        element the range holds; ``read(slot, lo, hi)`` gives elements ``[lo, hi)`` of one parameter, or
        None to leave them as they are."""
        end = start + into.numel()
        for slot in self.slots:
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi:
                values = read(slot, lo - slot.offset, hi - slot.offset)
                if values is not None:
                    into[lo - start: hi - start].copy_(values.to(into.dtype))


@dataclass(frozen=True)
class ShardRanks:
    """This rank's position in the group each bucket is sharded over: among the data-parallel ranks,
    or, for a bucket of experts, among the ranks that hold the same experts."""

    data: int
    experts: int = 0

    def of(self, bucket: BucketLayout) -> int:
        return self.experts if bucket.experts else self.data


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

    def trainable(self) -> "FlatLayout":
        """The buckets of trainable parameters (they come before any frozen bucket)."""
        kept = tuple(b for b in self.buckets if not b.frozen)
        assert all(b.index == i for i, b in enumerate(kept)), "trainable buckets must come first"
        return FlatLayout(kept, self.world_size)


def size_runs(indices: Iterable[int], numels: Sequence[int], group_of: Sequence[Hashable],
              bucket_numel: int) -> list[list[int]]:
    """Cut ``indices`` (in the order given) into runs of one optimizer group of about ``bucket_numel``.

    A run closes once it holds ``bucket_numel`` elements or when the group changes, so a parameter
    larger than ``bucket_numel`` ends up alone.
    """
    runs: list[list[int]] = []
    size = 0
    for i in indices:
        if not runs or group_of[i] != group_of[runs[-1][0]] or size >= bucket_numel:
            runs.append([])
            size = 0
        runs[-1].append(i)
        size += numels[i]
    return runs


class LayoutBuilder:
    """Lays buckets out one after another in the flat buffer, each padded to a multiple of the world size."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], world_size: int) -> None:
        self.params = params
        self.names = names
        self.world_size = world_size
        self.buckets: list[BucketLayout] = []
        self.offset = 0

    def add(self, indices: Sequence[int], group: int, frozen: bool = False, experts_world_size: int = 0) -> int:
        """Append a bucket holding ``indices`` (in that order); returns its index.  ``experts_world_size``:
        a bucket of experts, sharded over that many ranks."""
        slots, pos = [], 0
        for i in indices:
            p = self.params[i]
            slots.append(ParamSlot(i, self.names[i], pos, p.numel(), tuple(p.shape)))
            pos += p.numel()
        world_size = experts_world_size or self.world_size
        padded = -(-pos // world_size) * world_size
        self.buckets.append(BucketLayout(len(self.buckets), group, self.offset, pos, padded, tuple(slots),
                                         world_size, frozen, experts=experts_world_size > 0))
        self.offset += padded
        return len(self.buckets) - 1

    def layout(self) -> FlatLayout:
        return FlatLayout(tuple(self.buckets), self.world_size)


#: a bucket holds at most this fraction of the trainable elements (see [Note: buckets smaller than the model])
BUCKETS_PER_MODEL = 8
#: ... but is never capped below this many elements (small models keep the configured size)
MIN_CAPPED_BUCKET = 4 * 2**20


def capped_bucket_numel(configured: int, trainable_numel: int, per_model: int = BUCKETS_PER_MODEL) -> int:
    """[Note: buckets smaller than the model]
    DeepSpeed's default ``reduce_bucket_size`` (5e8 elements) is larger than most models trained on a
    handful of devices, so a bucket is the whole model: the full-size buffer that stage 2 fills and
    reduce-scatters is then as large as the gradients stage 2 exists to shard, nothing overlaps
    backward, and the first layer of the next forward needs the whole post-step gather.  At stages
    0-2 a bucket therefore holds at most 1/``per_model`` of the trainable elements (never less than
    ``MIN_CAPPED_BUCKET``): ``BUCKETS_PER_MODEL`` at stages 0-1, twice as many at stage 2, whose
    three pooled buffers (two in flight, one filling) then hold at most ~3/16 of a full gradient
    (see [Note: stage 2's own chunk is reduced in place] in sharding/grad_chunks.py).  A configured size below the
    cap is used as it is.
    """
    cap = max(-(-trainable_numel // per_model), MIN_CAPPED_BUCKET)
    return min(int(configured), cap)


def runs_by_kind(indices: Iterable[int], numels: Sequence[int], kind: Sequence[Hashable],
                 bucket_numel: int) -> list[list[int]]:
    """[Note: buckets of groups that alternate]
    Where the parameter groups alternate in model order (Muon's matrices and their biases, see [Note:
    DeepSpeed's Muon split] in optim/muon.py), :func:`size_runs` would close a run at every change, one
    bucket per parameter: as many collectives.  Here each kind keeps a run of its own open, which
    closes at about ``bucket_numel``, so a run gathers its kind's parameters from several layers.  The
    runs are ordered by their last parameter in the order given (reverse registration, close to
    backward's): the order in which backward completes them, so launching buckets in order (see
    [Note: launching buckets in order] in sharding/strategy.py) waits for nothing but each bucket's own
    gradients."""
    open_runs: dict[Hashable, tuple[list[int], int]] = {}  # kind -> (run, elements)
    last: dict[Hashable, int] = {}  # kind -> position of its open run's last parameter
    closed: list[tuple[int, list[int]]] = []  # (position of the last parameter, run)
    for position, i in enumerate(indices):
        run, size = open_runs.pop(kind[i], ([], 0))
        run.append(i)
        size += numels[i]
        if size >= bucket_numel:
            closed.append((position, run))
        else:
            open_runs[kind[i]] = (run, size)
            last[kind[i]] = position
    closed += [(last[k], run) for k, (run, _) in open_runs.items()]
    return [run for _, run in sorted(closed, key=lambda item: item[0])]


def plan_buckets(params: Sequence[torch.Tensor], names: Sequence[str], group_of: Sequence[int],
                 bucket_numel: int, world_size: int, experts: Collection[int] = (),
                 experts_world_size: int = 0, interleaved_groups: bool = False) -> FlatLayout:
    """Group parameters (in reverse order, see [Note: bucket order]) into buckets of about ``bucket_numel``;
    the parameters ``experts`` (indices) into buckets of their own, sharded over ``experts_world_size``;
    ``interleaved_groups``: see [Note: buckets of groups that alternate]."""
    builder = LayoutBuilder(params, names, world_size)
    kind = [(group_of[i], i in experts) for i in range(len(params))]
    plan = runs_by_kind if interleaved_groups else size_runs
    for run in plan(reversed(range(len(params))), [p.numel() for p in params], kind, bucket_numel):
        builder.add(run, group_of[run[0]], experts_world_size=experts_world_size if run[0] in experts else 0)
    return builder.layout()
