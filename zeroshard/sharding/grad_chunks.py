"""Where stages 2-3 keep each bucket's averaged gradient chunk: one policy per way, chosen once.

A stage that reduce-scatters every bucket (:class:`~.sharded_grads.ShardedGradientStrategy`) keeps,
per bucket, only this rank's chunk of the averaged gradient, from its first reduction of an optimizer
step until the optimizer has stepped it.  How that chunk is summed and where its memory comes from is a
:class:`GradientChunks` policy, which the stage picks when it is built:

- :class:`InPlaceChunks` (stage 2): a chunk kept for the run, which the reduce-scatter sums into.
- :class:`ChunksPerBucket` (stage 2 where the sum cannot accumulate in place): born from the reduced
  bucket at the first reduction of a step, freed at the step.
- :class:`KeptChunkBuffers` (stage 3): born into a buffer kept for the run, whose pages go at the step.

The strategy asks the policy, in every hot method, only what differs: where a gradient is stored,
where the reduce-scatter sums this rank's part, what the chunk is after the reduction, what goes at the
step, and how much memory the chunks and the pooled bucket buffers hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Collection, Optional, Sequence

import torch

from ..host.buffer_memory import BufferMemory
from ..precision import PrecisionPolicy
from .buffer_pool import KeptBuffers
from .layout import BucketLayout, ParamSlot, ShardRanks


class GradientChunks(ABC):
    """This rank's averaged gradient chunk of every bucket, held from its first reduction of a step to
    the step; ``divisor``: the ranks a gradient is averaged over."""

    def __init__(self, precision: PrecisionPolicy, divisor: int, ranks: ShardRanks, device: torch.device) -> None:
        self.precision = precision
        self.divisor = divisor
        #: this rank's chunk of each bucket
        self.ranks = ranks
        self.device = device
        self.dtype = precision.grad_accum
        #: bucket index -> its chunk, holding the sum of the reductions since the last step
        self._held: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ backward
    @abstractmethod
    def store(self, full: torch.Tensor, bucket: BucketLayout, slot: ParamSlot, grad: torch.Tensor,
              first: bool) -> None:
        """Copy one parameter's flattened gradient, divided, where its bucket's reduction reads it;
        ``full`` is the bucket buffer being filled; ``first``: its first gradient of this backward."""

    @abstractmethod
    def ready_to_reduce(self, full: torch.Tensor, bucket: BucketLayout, arrived: Collection[int]) -> Optional[torch.Tensor]:
        """Zero what nothing was stored in (``arrived``: the parameters that were); return where the
        reduce-scatter sums this rank's chunk (None: its own chunk of ``full``)."""

    def reduce_into(self, full: torch.Tensor, bucket: BucketLayout) -> Optional[torch.Tensor]:
        """Where a reduce-scatter of ``full`` may write this rank's summed chunk, apart from ``full``
        (None: in ``full``'s own chunk); :meth:`take_reduced` finds the sum there."""
        return None

    @abstractmethod
    def take_reduced(self, full: torch.Tensor, bucket: BucketLayout) -> None:
        """``full``'s reduction has finished: this rank's averaged part of it joins the bucket's chunk."""

    @abstractmethod
    def pool_numel_written(self, buckets: Sequence[BucketLayout], capacity: int) -> int:
        """Elements of a pooled bucket buffer (``capacity`` elements) that storing and reducing ever
        write: the rest of its pages never become resident."""

    # ------------------------------------------------------------------ the optimizer step
    def owned(self, bucket: BucketLayout) -> torch.Tensor:
        """The bucket's averaged chunk (zeros if nothing was reduced since the last step)."""
        held = self._held.get(bucket.index)
        if held is None:  # no reduction since the last step (a step without backward is refused earlier)
            held = self._held[bucket.index] = self._new_chunk(bucket).zero_()
        return held

    def release(self, bucket: BucketLayout) -> None:
        """The optimizer has stepped ``bucket``: its chunk holds nothing the next backward adds to."""
        self._held.pop(bucket.index, None)

    def held_bytes(self) -> int:
        """Bytes the chunks hold right now."""
        return sum(chunk.untyped_storage().nbytes() for chunk in self._held.values())

    @abstractmethod
    def _new_chunk(self, bucket: BucketLayout) -> torch.Tensor:
        """A home for the bucket's chunk (1D, ``shard_numel``, in the accumulation dtype), values undefined."""


class InPlaceChunks(GradientChunks):
    """[Note: stage 2's own chunk is reduced in place]
    Each bucket's chunk of this rank is a tensor kept for the run.  Backward copies each gradient into
    the bucket being filled, except the elements of this rank's own chunk, which go straight into the
    kept chunk (added to it when it already holds earlier micro steps' sum); the reduce-scatter adds
    the other ranks' partial sums into the kept chunk (``own_input``: the ring reads the own chunk
    only at its last step).  So no chunk is copied out of a reduced bucket, and a pooled bucket
    buffer's own part is never written: its pages never become resident (the pool drops them when it
    makes a buffer), and the pool costs (N-1)/N of its buffers.  Stage 2's buckets are 1/16 of the
    model (``StageTraits.buckets_per_model``), so its three pooled buffers hold 3/16 of a full
    gradient.  Where the sum cannot accumulate in the chunk (:meth:`fits`) the chunk is born from the
    reduced bucket instead (:class:`ChunksPerBucket`).

    Why kept for the run: a chunk born at each backward and freed at each step takes the heap holes
    that the freed activations leave, and freeing it at the step lets glibc trim the heap's top, which
    the next backward faults in again.  A kept chunk is faulted in once, and at stage 2's peak, in
    backward, it costs about what a born chunk and the bucket buffer's own part it is copied from cost.
    """

    def __init__(self, precision: PrecisionPolicy, divisor: int, ranks: ShardRanks, device: torch.device) -> None:
        super().__init__(precision, divisor, ranks, device)
        self._kept: dict[int, torch.Tensor] = {}  # bucket index -> its chunk, made at its first use

    @staticmethod
    def fits(reduce_scatter: bool, precision: PrecisionPolicy) -> bool:
        """Whether the sum can accumulate in a kept chunk: a reduce-scatter (not an all-reduce) whose
        result needs no scaling afterwards (no prescaled average), in the chunk's own dtype."""
        return reduce_scatter and not precision.scales_after_reduction and precision.comm == precision.grad_accum

    def store(self, full: torch.Tensor, bucket: BucketLayout, slot: ParamSlot, grad: torch.Tensor,
              first: bool) -> None:
        """The slot's elements outside this rank's chunk go into ``full``, the others into the chunk."""
        start, end = bucket.shard_range(self.ranks.of(bucket))
        for lo, hi in ((slot.offset, min(slot.offset + slot.numel, start)),
                       (max(slot.offset, end), slot.offset + slot.numel)):
            if lo < hi:
                self.precision.store_divided(full[lo:hi], grad[lo - slot.offset: hi - slot.offset], self.divisor,
                                             accumulate=not first)
        lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
        if lo < hi:
            held = bucket.index in self._held  # summed over earlier micro steps: added to
            own = self._new_chunk(bucket)[lo - start: hi - start]
            self.precision.store_divided(own, grad[lo - slot.offset: hi - slot.offset], self.divisor,
                                         accumulate=held or not first)

    def ready_to_reduce(self, full: torch.Tensor, bucket: BucketLayout, arrived: Collection[int]) -> Optional[torch.Tensor]:
        start, end = bucket.shard_range(self.ranks.of(bucket))
        chunk = self._new_chunk(bucket)
        bucket.zero_unwritten(full[:start], arrived)
        bucket.zero_unwritten(full[end:], arrived, start=end)
        if bucket.index not in self._held:  # else it holds the earlier micro steps' sum
            bucket.zero_unwritten(chunk, arrived, start=start)
        return chunk

    def take_reduced(self, full: torch.Tensor, bucket: BucketLayout) -> None:
        """The sum is in the kept chunk already."""
        self._held[bucket.index] = self._new_chunk(bucket)

    def pool_numel_written(self, buckets: Sequence[BucketLayout], capacity: int) -> int:
        """The union of every bucket's elements outside this rank's own chunk."""
        spans = []
        for bucket in buckets:
            start, end = bucket.shard_range(self.ranks.of(bucket))
            spans += [span for span in ((0, start), (end, bucket.padded_numel)) if span[0] < span[1]]
        spans.sort()
        total, reach = 0, 0
        for lo, hi in spans:
            total += max(0, hi - max(lo, reach))
            reach = max(reach, hi)
        return total

    def held_bytes(self) -> int:
        """Kept for the run, whether they hold a gradient now or not."""
        return sum(chunk.untyped_storage().nbytes() for chunk in self._kept.values())

    def _new_chunk(self, bucket: BucketLayout) -> torch.Tensor:
        """The bucket's kept chunk, made at its first use."""
        chunk = self._kept.get(bucket.index)
        if chunk is None:
            chunk = torch.empty(bucket.shard_numel, dtype=self.dtype, device=self.device)
            self._kept[bucket.index] = chunk
        return chunk


class ReducedInBucket(GradientChunks):
    """The reduce-scatter sums this rank's part in the bucket buffer's own chunk, from which the
    bucket's chunk is born at its first reduction of a step (a copy) and to which later micro steps'
    reductions are added.  The chunk is born after the reduction rather than at launch for the
    reduce-scatter to write into: at launch the activations it could reuse are still alive, so it
    would come from fresh pages."""

    def store(self, full: torch.Tensor, bucket: BucketLayout, slot: ParamSlot, grad: torch.Tensor,
              first: bool) -> None:
        into = full[slot.offset: slot.offset + slot.numel]
        self.precision.store_divided(into, grad, self.divisor, accumulate=not first)

    def ready_to_reduce(self, full: torch.Tensor, bucket: BucketLayout, arrived: Collection[int]) -> Optional[torch.Tensor]:
        bucket.zero_unwritten(full, arrived)  # a parameter unused in this forward: zeros, as on every other rank
        return None

    def take_reduced(self, full: torch.Tensor, bucket: BucketLayout) -> None:
        start, end = bucket.shard_range(self.ranks.of(bucket))
        received = full[start:end]  # the reduction was in place (see ShardingStrategy.reduce_to_owner)
        self.precision.after_reduction(received, self.divisor)
        held = self._held.get(bucket.index)
        if held is None:  # the first reduction since the last step: the chunk is born
            self._held[bucket.index] = self._new_chunk(bucket).copy_(received)
        else:
            held.add_(received)

    def pool_numel_written(self, buckets: Sequence[BucketLayout], capacity: int) -> int:
        """Every element: each bucket's own chunk receives its reduction."""
        return capacity


class ChunksPerBucket(ReducedInBucket):
    """Each chunk born from the heap, where backward's freed activations leave room, and freed at the
    step: stage 2 where its sum cannot accumulate in a kept chunk (prescaled gradients, a communication
    dtype other than the chunk's, an all-reduce instead of a reduce-scatter)."""

    def _new_chunk(self, bucket: BucketLayout) -> torch.Tensor:
        return torch.empty(bucket.shard_numel, dtype=self.dtype, device=self.device)


class KeptChunkBuffers(ReducedInBucket):
    """[Note: where gradient chunks live]
    At stage 3 each bucket's chunk has a buffer of its own, kept for the run, whose pages go when the
    optimizer has stepped the bucket and come back at its first reduction of the next step
    (``KeptBuffers``; in host memory they are parked in the engine's page reserve, whence the next
    gathers take them: [Note: released pages move to the next gather] in host/page_reserve.py).  Stage
    3 is the memory-first stage: from the step to the next backward, through the forward where the
    gathered units add to the activations, its gradient chunks hold no memory, and a buffer whose
    pages go leaves no hole in the heap that the activations would have to fill.  Stage 2 keeps its
    chunks whole instead ([Note: stage 2's own chunk is reduced in place]): its peak is in backward,
    where the chunks are live anyway.

    [Note: stage 3's first reduction lands in its chunk]
    A bucket's first reduction of a step writes its sum straight into the chunk's buffer, which it takes
    at launch (:meth:`reduce_into`): the reduce-scatter's output is the buffer instead of the bucket's
    own chunk, so no chunk is copied out of a reduced bucket.  The ring computes the same additions
    into another place, so the sum has the same bits.  Taking the buffer at launch rather than after the
    reduction costs nothing that the heap would give: its pages come from the engine's buffer memory,
    not from the activations freed meanwhile (what :class:`ReducedInBucket` waits for), and a bucket is
    in flight for at most ``StageTraits.max_buckets_in_flight`` buckets' backward.  Later micro steps'
    reductions, and a communication dtype other than the chunk's, still reduce in the bucket and are
    added or copied in (rounded) by :meth:`take_reduced`.
    """

    def __init__(self, precision: PrecisionPolicy, divisor: int, ranks: ShardRanks, device: torch.device,
                 memory: BufferMemory) -> None:
        super().__init__(precision, divisor, ranks, device)
        #: one buffer per bucket, whose memory comes and goes through the engine's ``memory`` (see the Note)
        self.buffers = KeptBuffers(device, memory)
        #: bucket index -> the chunk its reduction in flight writes into (see [Note: stage 3's first
        #: reduction lands in its chunk])
        self._reducing: dict[int, torch.Tensor] = {}

    def reduce_into(self, full: torch.Tensor, bucket: BucketLayout) -> Optional[torch.Tensor]:
        """The chunk's buffer, at the bucket's first reduction of a step in the chunk's dtype (see the Note)."""
        if bucket.index in self._held or full.dtype != self.dtype:
            return None
        chunk = self._reducing[bucket.index] = self._new_chunk(bucket)
        return chunk

    def take_reduced(self, full: torch.Tensor, bucket: BucketLayout) -> None:
        chunk = self._reducing.pop(bucket.index, None)
        if chunk is None:
            super().take_reduced(full, bucket)
            return
        self.precision.after_reduction(chunk, self.divisor)
        self._held[bucket.index] = chunk

    def _new_chunk(self, bucket: BucketLayout) -> torch.Tensor:
        return self.buffers.take(bucket.index, bucket.shard_numel, self.dtype)

    def release(self, bucket: BucketLayout) -> None:
        """The chunk's pages go until its next reduction (see the Note)."""
        if self._held.pop(bucket.index, None) is not None:
            self.buffers.give_back(bucket.index)
