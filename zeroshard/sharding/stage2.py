"""ZeRO stage 2: gradients sharded too: each bucket is reduce-scattered as backward fills it."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..config import ZeroConfig
from ..distributed.collectives import PendingCollective
from ..distributed.topology import ShardGroups
from ..precision import PrecisionPolicy
from .buffer_pool import BufferPool, KeptBuffers
from .layout import BUCKETS_PER_MODEL, BucketLayout, ParamSlot
from .storage import ParameterStorage
from .strategy import ShardingStrategy


class Stage2(ShardingStrategy):
    """Only this rank's gradient chunks persist (4Ψ/N); full-size buckets live only while in flight.

    [Note: stage-2 accumulation]
    Gradients are reduced at every micro step (there is nowhere to keep a full-size gradient between
    micro steps) and the averaged chunks are added into a persistent shard accumulator.  Under
    accumulation this communicates K times per optimizer step where stage 1 communicates once: the
    price of holding 4Ψ/N instead of 4Ψ of gradients, as in DeepSpeed.

    Each bucket's averaged chunk is kept for the run (see the next Note): 174 MiB per rank for a 91M
    model at world 2, the 4Ψ/N of ZeRO's formula.

    [Note: stage 2's own chunk is reduced in place]
    Each bucket's chunk of this rank is a tensor kept for the run.  Backward copies each gradient into
    the bucket being filled, except the elements of this rank's own chunk, which go straight into the
    kept chunk (added to it when it already holds earlier micro steps' sum); the reduce-scatter adds
    the other ranks' partial sums into the kept chunk (``own_input``: the ring reads the own chunk
    only at its last step).  So no chunk is copied out of a reduced bucket, and a pooled bucket
    buffer's own part is never written: its pages never become resident (the pool drops them when
    it makes a buffer), and the pool costs (N-1)/N of its buffers.  Buckets are 1/16 of the model
    here (``buckets_per_model``), so the three pooled buffers hold 3/16 of a full gradient.
    Where the sum cannot accumulate in the chunk (prescaled gradients, a communication dtype other
    than the chunk's, all-reduce instead of reduce-scatter) the chunk is born from the reduced
    bucket instead, as it used to be ([Note: where gradient chunks live]).

    Why kept: a chunk born at each backward and freed at each step takes the heap holes that the
    freed activations leave, and the step's freeing of them lets glibc trim the heap's top, which
    the next backward faults in again.  Measured at 91M fp32, world 2, DeepSpeed's defaults,
    glibc's, beside DDP in one world (6-8 rounds): born chunks, 16,900-33,200 minor faults per
    backward (DDP 1,600-12,500) and backward 1.07-1.13x DDP's; kept chunks summed in place,
    6,800-10,200 faults and backward 0.99-1.04x DDP's; the step 1.068x DDP's against 1.152x with born
    chunks in the same world, and 1.023x DDP's in benchmarks/bench_step_ratio.py (8 pairs; born
    chunks: 1.035-1.040 in four of five earlier runs).  Peak RSS (benchmarks/bench_memory.py, 4
    steps): 1689-1704 MiB in two runs against 1599-1707 for born chunks (1616-1707 the same day),
    under the 1730 target: the kept chunks cost about what the bucket buffers' own parts and the
    chunks' copies cost before, and the peak varies less.

    [Note: where gradient chunks live]
    Born chunks (above) were allocated from the heap: backward frees activations as it goes, and the
    chunks reused that memory.  At stage 3 each bucket's chunk has a buffer of its own, kept for the
    run, whose pages go when the chunk is released (``KeptBuffers``, as stage 3's units: [Note:
    released pages move to the next gather] in host/page_reserve.py): its peak is at the end of the
    forward, where the chunks freed by the last step were holes in the heap that the activations did
    not fill.  Measured at 91M fp32, world 2, DeepSpeed's defaults, glibc's (benchmarks/bench_memory.py,
    4 steps, three runs each): stage 3 peaked at 1832-1937 MiB with kept chunks, 1951-2067 with heap
    chunks.  Stage 2 kept its chunks whole for the run, with full-size pooled buffers of 1/8 of the
    model and the chunk copied out of each reduced bucket, at 1780/1781 MiB (over the 1730 its
    memory target allows), and at 1706-1739 with 1/16 buckets and the reduction summing straight into
    the chunk but the buffers' own parts still resident: only with those never touched (the Note
    above) does it stay under the target.

    [Note: when the bucket pool lets go]
    The full-size bucket buffers are needed from the first gradient of a backward to its last
    reduction.  Stage 2 keeps their memory from one backward to the next: its peak is in backward,
    where the buffers are live anyway, so holding them through the forward does not raise it, while
    giving their pages back made every backward fault them in again, cold (on a VM that reports free
    pages to its hypervisor, see [Note: releasing a gathered unit's pages] in host/page_release.py).
    Measured at 91M fp32, world 2, DeepSpeed's defaults (three 45 MiB buffers), stage 2 beside DDP in
    one world: backward 4.17-4.30 s with 0.55-0.76 s of system time when the pages were given back,
    3.52-3.75 s with 0.25-0.42 s when kept (DDP: 3.15-3.61 s, 0.17-0.25 s); the whole step 1.177 and
    1.173x DDP's against 1.100 and 1.096x (benchmarks/bench_step_ratio.py, two runs each, alternated);
    peak RSS 1719/1654 MiB against 1725/1644 (both in backward).  Stage 3 gave them back (to its page
    reserve) until the twentieth session, when its forward peak was the higher one; once its gathers
    moved the lent chunks' pages instead of faulting new ones ([Note: a gathered unit borrows this
    rank's chunk] in sharded_params.py), its peak moved into backward too, and keeping its 27 MiB
    buffers took the backward's page faults from 12,000-15,000 to 4,000-5,000 (91M fp32, world 2)
    with the peak still in backward (benchmarks/RESULTS.md, twentieth session).
    """

    stage = 2
    buckets_per_model = 2 * BUCKETS_PER_MODEL  # see [Note: stage 2's own chunk is reduced in place]
    defers_refresh = True
    reduces_every_micro_step = True
    keeps_chunk_buffers = False  # see [Note: where gradient chunks live]

    def __init__(self, flat: ParameterStorage, params: Sequence[nn.Parameter], groups: ShardGroups,
                 zero: ZeroConfig, precision: PrecisionPolicy = PrecisionPolicy()) -> None:
        super().__init__(flat, params, groups, zero, precision)
        self._grad_chunks: dict[int, torch.Tensor] = {}  # bucket index -> this rank's averaged chunk
        #: stage 3: where each bucket's chunk lives while held (see [Note: where gradient chunks live])
        reserve = self.flat.page_reserve  # stage 3: see [Note: released pages move to the next gather]
        self._chunk_buffers = KeptBuffers(self.flat.device, reserve) if self.keeps_chunk_buffers else None
        #: whether each bucket's own chunk is summed in place in a chunk kept for the run (see [Note:
        #: stage 2's own chunk is reduced in place]); else it is born from the reduced bucket
        self._in_place = (not self.keeps_chunk_buffers and zero.reduce_scatter and not precision.prescale
                          and precision.comm == precision.grad_accum)
        self._kept_chunks: dict[int, torch.Tensor] = {}  # bucket index -> its chunk, when summed in place
        self._buffers: dict[int, torch.Tensor] = {}  # bucket index -> full bucket being filled or in flight
        largest = max(b.padded_numel for b in self.layout.buckets)
        self._bucket_pool = BufferPool(largest, self.precision.comm, self.flat.device)  # filled, then reduced

    def _bucket_buffer(self, bucket: BucketLayout) -> torch.Tensor:
        buffer = self._buffers.get(bucket.index)
        if buffer is None:
            buffer = self._bucket_pool.acquire(bucket.padded_numel)
            self._buffers[bucket.index] = buffer
        return buffer

    def comm_buffer_bytes(self) -> int:
        """The pool's buffers, counted by the elements that are ever written in them: in place, no
        bucket's own chunk is (its pages are never touched)."""
        pool = self._bucket_pool
        written = self._written_pool_numel() if self._in_place else pool.capacity
        return pool.count * written * pool.dtype.itemsize + super().comm_buffer_bytes()

    def _written_pool_numel(self) -> int:
        """Elements of a pool buffer that some bucket writes: the union of every bucket's elements
        outside this rank's own chunk."""
        spans = []
        for bucket in self.layout.buckets:
            start, end = bucket.shard_range(self.world.rank)
            spans += [span for span in ((0, start), (end, bucket.padded_numel)) if span[0] < span[1]]
        spans.sort()
        total, reach = 0, 0
        for lo, hi in spans:
            total += max(0, hi - max(lo, reach))
            reach = max(reach, hi)
        return total

    def store_grad(self, bucket: BucketLayout, slot: ParamSlot, grad: torch.Tensor, first: bool) -> None:
        """See [Note: filling a stage-2 bucket] and [Note: stage 2's own chunk is reduced in place]."""
        full = self._bucket_buffer(bucket)
        divisor = self.data_parallel_size
        if not self._in_place:
            into = full[slot.offset: slot.offset + slot.numel]
            self.precision.store_divided(into, grad, divisor, accumulate=not first)
            return
        start, end = bucket.shard_range(self.world.rank)
        held = bucket.index in self._grad_chunks  # summed over earlier micro steps: added to
        for lo, hi in ((slot.offset, min(slot.offset + slot.numel, start)),
                       (max(slot.offset, end), slot.offset + slot.numel)):
            if lo < hi:
                self.precision.store_divided(full[lo:hi], grad[lo - slot.offset: hi - slot.offset], divisor,
                                             accumulate=not first)
        lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
        if lo < hi:
            own = self._kept_chunk(bucket)[lo - start: hi - start]
            self.precision.store_divided(own, grad[lo - slot.offset: hi - slot.offset], divisor,
                                         accumulate=held or not first)

    def launch(self, bucket: BucketLayout, async_op: bool) -> PendingCollective:
        """[Note: filling a stage-2 bucket]
        A bucket's buffer comes from the pool as it was left (the last reduction's scratch), and
        every element is written once before the reduction: each parameter's gradient is *copied*
        in, already divided by the number of ranks (``PrecisionPolicy.store_divided``), and at launch
        the slots that got no gradient and the padding are zeroed.  Zeroing the whole buffer when
        it was handed out, adding each gradient into the zeros and dividing the whole bucket before
        the reduction were two more passes over every gradient, and a slower third, on the training
        thread: at 91M fp32, world 2, 0.4-0.5 s of its CPU time per backward went to the buckets
        (scratch instrumentation: zeroing 0.13 s, adding 0.18, the chunks' births 0.17-0.25; a
        2-core host whose memory bandwidth the two ranks share).  A parameter whose gradient arrives
        twice in one backward (a region checkpointed with ``use_reentrant=True``, whose nested
        backward accumulates separately) adds the second.

        The chunk is still born after the reduction, by a copy out of the bucket.  Reducing straight
        into a chunk born at launch saves that copy but made the backward slower (0.3-0.4 s, 91M,
        in the same world as this way): the chunks, allocated while the activations they used to
        reuse were still alive, came from fresh pages (29,000-40,000 page faults per backward
        against 14,000-31,000).
        """
        full = self._bucket_buffer(bucket)
        arrived = self._progress[bucket.index].arrived
        if not self._in_place:
            with torch.no_grad():  # a parameter unused in this forward: zeros, as on every other rank
                bucket.zero_unwritten(full, arrived)
            return self.reduce_to_owner(bucket, full, async_op)
        start, end = bucket.shard_range(self.world.rank)
        chunk = self._kept_chunk(bucket)
        with torch.no_grad():
            bucket.zero_unwritten(full[:start], arrived)
            bucket.zero_unwritten(full[end:], arrived, start=end)
            if bucket.index not in self._grad_chunks:  # else it holds the earlier micro steps' sum
                bucket.zero_unwritten(chunk, arrived, start=start)
        return self.reduce_to_owner(bucket, full, async_op, own=chunk)

    def complete(self, bucket: BucketLayout) -> None:
        full = self._buffers.pop(bucket.index)
        if self._in_place:  # the sum is in the kept chunk already
            self._grad_chunks[bucket.index] = self._kept_chunk(bucket)
            self._bucket_pool.release(full)
            return
        start, end = bucket.shard_range(self.world.rank)
        received = full[start:end]  # the reduction was in place (see reduce_to_owner)
        self.precision.after_reduction(received, self.data_parallel_size)
        held = self._grad_chunks.get(bucket.index)
        if held is None:  # the first reduction since zero_grad: the chunk is born
            self._grad_chunks[bucket.index] = self._chunk(bucket).copy_(received)
        else:
            held.add_(received)
        self._bucket_pool.release(full)

    def owned_grad(self, bucket: BucketLayout) -> torch.Tensor:
        held = self._grad_chunks.get(bucket.index)
        if held is None:  # no reduction since zero_grad (a step without backward is refused earlier)
            held = self._grad_chunks[bucket.index] = self._chunk(bucket).zero_()
        return held

    def _kept_chunk(self, bucket: BucketLayout) -> torch.Tensor:
        """The bucket's chunk kept for the run, made at its first use (see [Note: stage 2's own chunk is
        reduced in place])."""
        chunk = self._kept_chunks.get(bucket.index)
        if chunk is None:
            chunk = torch.empty(bucket.shard_numel, dtype=self.precision.grad_accum, device=self.flat.device)
            self._kept_chunks[bucket.index] = chunk
        return chunk

    def _chunk(self, bucket: BucketLayout) -> torch.Tensor:
        """A new home for the bucket's chunk: kept for the run (in place), from the heap, or (stage 3)
        its kept buffer."""
        if self._in_place:
            return self._kept_chunk(bucket)
        if self._chunk_buffers is None:
            return torch.empty(bucket.shard_numel, dtype=self.precision.grad_accum, device=self.flat.device)
        return self._chunk_buffers.take(bucket.index, bucket.shard_numel, self.precision.grad_accum)

    def release_grad(self, bucket: BucketLayout) -> None:
        if self._grad_chunks.pop(bucket.index, None) is not None and self._chunk_buffers is not None:
            self._chunk_buffers.give_back(bucket.index)

    def zero_grad(self) -> None:
        for bucket in self.layout.buckets:
            self.release_grad(bucket)

    def held_grad_bytes(self) -> int:
        if self._in_place:  # kept for the run, whether they hold a gradient now or not
            return sum(chunk.untyped_storage().nbytes() for chunk in self._kept_chunks.values())
        return sum(chunk.untyped_storage().nbytes() for chunk in self._grad_chunks.values())

    def grad_bytes(self) -> tuple[int, int]:
        """The chunks' bytes from the end of backward to the step (see the Note), and their padding."""
        size = self.precision.grad_accum.itemsize
        real = self.owned_real_numel()
        return real * size, (self.layout.shard_numel() - real) * size
