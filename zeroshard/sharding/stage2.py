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
from .layout import BucketLayout, ParamSlot
from .storage import ParameterStorage
from .strategy import ShardingStrategy


class Stage2(ShardingStrategy):
    """Only this rank's gradient chunks persist (4Ψ/N); full-size buckets live only while in flight.

    [Note: stage-2 accumulation]
    Gradients are reduced at every micro step (there is nowhere to keep a full-size gradient between
    micro steps) and the averaged chunks are added into a persistent shard accumulator.  Under
    accumulation this communicates K times per optimizer step where stage 1 communicates once: the
    price of holding 4Ψ/N instead of 4Ψ of gradients, as in DeepSpeed.

    Each bucket's averaged chunk is born from its first reduction of a step (see [Note: gradients
    live from backward to the step] in strategy.py): 174 MiB per rank for a 91M model at world 2 that
    the forward no longer holds.

    [Note: where gradient chunks live]
    At stage 2 a chunk is allocated from the heap when it is born: backward frees activations as it
    goes, and the chunks reuse that memory.  At stage 3 each bucket's chunk has a buffer of its own,
    kept for the run, whose pages go when the chunk is released (``KeptBuffers``, as stage 3's units:
    [Note: released pages move to the next gather] in memory/page_reserve.py): its peak is at
    the end of the forward, where the chunks freed by the last step were holes in the heap that the
    activations did not fill.  Measured at 91M fp32, world 2, DeepSpeed's defaults, glibc's
    (benchmarks/bench_memory.py, 4 steps, three runs each): stage 3 peaked at 1832-1937 MiB with
    kept chunks, 1951-2067 with heap chunks; stage 2 at 1777-1873 with kept chunks, 1734-1775 with
    heap chunks.

    Keeping stage 2's chunks resident for the run (never freed, pages kept) was measured too: the
    heap chunks take the holes the freed activations leave, so backward's own temporaries extend
    the heap and fault (up to 37,000 minor faults per backward at 91M fp32, world 2, almost none in
    the chunks' births themselves; 2,600-7,200 with resident chunks, DDP up to 11,700), and backward
    took 0.1-0.15 s longer (system time 0.32 against 0.16 s; the step 1.024 against 0.980x DDP's,
    median of 6 in one world).  But resident chunks live beside the whole forward's activations:
    peak RSS 1780/1781 MiB against 1599/1627-1646, over the 1730 the memory target allows.  Kept off.
    Resident chunks that the reduce-scatter writes into directly (no birth copy), with buckets of
    1/16 of the model so that the pool holds half as much, were measured as well: backward 0.92-0.93x
    DDP's (3.00-3.03 s against 3.25-3.26, 7,500-9,200 faults), the step 1.016x DDP's (median of 6
    in one world), but peak RSS 1706-1739 MiB in two runs (1685/1710 with ~23 buckets) against
    1616-1681 for this layout the same hour: at the 1730 target, not under it.  Kept off too.

    [Note: when the bucket pool lets go]
    The full-size bucket buffers are needed from the first gradient of a backward to its last
    reduction.  Stage 2 keeps their memory from one backward to the next: its peak is in backward,
    where the buffers are live anyway, so holding them through the forward does not raise it, while
    giving their pages back made every backward fault them in again, cold (on a VM that reports free
    pages to its hypervisor, see [Note: releasing a gathered unit's pages] in memory/page_release.py).
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
        return self._bucket_pool.nbytes + super().comm_buffer_bytes()

    def store_grad(self, bucket: BucketLayout, slot: ParamSlot, grad: torch.Tensor, first: bool) -> None:
        """See [Note: filling a stage-2 bucket]."""
        into = self._bucket_buffer(bucket)[slot.offset: slot.offset + slot.numel]
        self.precision.store_divided(into, grad, self.data_parallel_size, accumulate=not first)

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
        with torch.no_grad():  # a parameter unused in this forward: zeros, as on every other rank
            bucket.zero_unwritten(full, self._progress[bucket.index].arrived)
        return self.reduce_to_owner(bucket, full, async_op)

    def complete(self, bucket: BucketLayout) -> None:
        full = self._buffers.pop(bucket.index)
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

    def _chunk(self, bucket: BucketLayout) -> torch.Tensor:
        """A new home for the bucket's chunk: from the heap, or (stage 3) its kept buffer."""
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
        return sum(chunk.untyped_storage().nbytes() for chunk in self._grad_chunks.values())

    def grad_bytes(self) -> tuple[int, int]:
        """The chunks' bytes from the end of backward to the step (see the Note), and their padding."""
        size = self.precision.grad_accum.itemsize
        real = self.owned_real_numel()
        return real * size, (self.layout.shard_numel() - real) * size
