"""What stages 2 and 3 share: every bucket reduce-scattered as backward fills it, into this rank's chunks.

[Note: stage-2 accumulation]
Gradients are reduced at every micro step (there is nowhere to keep a full-size gradient between micro
steps) and each bucket's averaged chunk accumulates the micro steps' sums.  Under accumulation this
communicates K times per optimizer step where stage 1 communicates once: the price of holding 4Ψ/N
instead of 4Ψ of gradients, as in DeepSpeed.

[Note: when the bucket pool lets go]
The full-size bucket buffers are needed from the first gradient of a backward to its last reduction.
Stages 2 and 3 keep their memory from one backward to the next: their peak is in backward, where the
buffers are live anyway, so holding them through the forward does not raise it, while giving their
pages back would make every backward fault them in again, cold (on a VM that reports free pages to its
hypervisor, see [Note: releasing a gathered unit's pages] in host/page_release.py).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..config import ZeroConfig
from ..distributed.collectives import PendingCollective
from ..distributed.topology import ShardGroups
from ..precision import PrecisionPolicy
from .buffer_pool import BufferPool
from .grad_chunks import GradientChunks
from .layout import BucketLayout, ParamSlot
from .storage import ParameterStorage
from .strategy import ShardingStrategy


class ShardedGradientStrategy(ShardingStrategy):
    """Only this rank's gradient chunks persist (4Ψ/N, where ``grad_chunks`` says); full-size buckets,
    from a pool kept for the run, live only while they fill and are reduced."""

    def __init__(self, storage: ParameterStorage, params: Sequence[nn.Parameter], groups: ShardGroups,
                 zero: ZeroConfig, precision: PrecisionPolicy, grad_chunks: GradientChunks) -> None:
        super().__init__(storage, params, groups, zero, precision)
        #: where each bucket's averaged chunk is summed and lives (chosen by the stage)
        self.grad_chunks = grad_chunks
        self._buffers: dict[int, torch.Tensor] = {}  # bucket index -> full bucket being filled or in flight
        largest = max(b.padded_numel for b in self.layout.buckets)
        self._bucket_pool = BufferPool(largest, self.precision.comm, self.storage.device,
                                       self.storage.buffer_memory)  # filled, then reduced

    def communicates_now(self) -> bool:
        """Every micro step (see [Note: stage-2 accumulation])."""
        return True

    def _bucket_buffer(self, bucket: BucketLayout) -> torch.Tensor:
        buffer = self._buffers.get(bucket.index)
        if buffer is None:
            buffer = self._bucket_pool.acquire(bucket.padded_numel)
            self._buffers[bucket.index] = buffer
        return buffer

    def store_grad(self, bucket: BucketLayout, slot: ParamSlot, grad: torch.Tensor, first: bool) -> None:
        """See [Note: filling a stage-2 bucket]."""
        self.grad_chunks.store(self._bucket_buffer(bucket), bucket, slot, grad, first)

    def launch(self, bucket: BucketLayout, async_op: bool) -> PendingCollective:
        """[Note: filling a stage-2 bucket]
        A bucket's buffer comes from the pool as it was left (the last reduction's scratch), and every
        element is written once before the reduction: each parameter's gradient is *copied* in,
        already divided by the number of ranks (``PrecisionPolicy.store_divided``), and at launch the
        slots that got no gradient and the padding are zeroed.  Zeroing the whole buffer when it is
        handed out, adding each gradient into the zeros and dividing the whole bucket before the
        reduction would be two more passes over every gradient, and a slower third, on the training
        thread.  A parameter whose gradient arrives twice in one backward (a region checkpointed with
        ``use_reentrant=True``, whose nested backward accumulates separately) adds the second.  Which
        elements go into the buffer and which straight into this rank's chunk is the chunk policy's
        (``GradientChunks.store``).
        """
        full = self._bucket_buffer(bucket)
        with torch.no_grad():
            own = self.grad_chunks.ready_to_reduce(full, bucket, self._progress[bucket.index].arrived)
        into = None
        if own is None and self.zero.reduce_scatter and self.quantised_reduction_of(bucket) is None:
            into = self.grad_chunks.reduce_into(full, bucket)  # a plain reduce-scatter may write elsewhere
        return self.reduce_to_owner(bucket, full, async_op, own=own, into=into)

    def complete(self, bucket: BucketLayout) -> None:
        full = self._buffers.pop(bucket.index)
        self.grad_chunks.take_reduced(full, bucket)
        self._bucket_pool.release(full)

    def owned_grad(self, bucket: BucketLayout) -> torch.Tensor:
        return self.grad_chunks.owned(bucket)

    def release_grad(self, bucket: BucketLayout) -> None:
        self.grad_chunks.release(bucket)

    def zero_grad(self) -> None:
        for bucket in self.layout.buckets:
            self.release_grad(bucket)

    def held_grad_bytes(self) -> int:
        return self.grad_chunks.held_bytes()

    def grad_bytes(self) -> tuple[int, int]:
        """The chunks' bytes from the end of backward to the step (see [Note: gradients live from
        backward to the step] in sharding/strategy.py), and their padding."""
        size = self.precision.grad_accum.itemsize
        real = self.owned_real_numel()
        return real * size, (self.layout.shard_numel() - real) * size

    def comm_buffer_bytes(self) -> int:
        """The pool's buffers, counted by the elements that are ever written in them (see [Note: stage
        2's own chunk is reduced in place] in sharding/grad_chunks.py)."""
        pool = self._bucket_pool
        written = self.grad_chunks.pool_numel_written(self.layout.buckets, pool.capacity)
        return pool.count * written * pool.dtype.itemsize + super().comm_buffer_bytes()
