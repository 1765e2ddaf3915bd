"""ZeRO stage 2: gradients sharded too: each bucket is reduce-scattered as backward fills it."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..config import ZeroConfig
from ..distributed.collectives import PendingCollective
from ..distributed.topology import ShardGroups
from ..precision import PrecisionPolicy
from .buffer_pool import BufferPool
from .layout import BucketLayout
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
    """

    stage = 2
    defers_refresh = True
    reduces_every_micro_step = True

    def __init__(self, flat: ParameterStorage, params: Sequence[nn.Parameter], groups: ShardGroups,
                 zero: ZeroConfig, precision: PrecisionPolicy = PrecisionPolicy()) -> None:
        super().__init__(flat, params, groups, zero, precision)
        self._grad_chunks: dict[int, torch.Tensor] = {}  # bucket index -> this rank's averaged chunk
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

    def store_grad(self, bucket: BucketLayout, offset: int, grad: torch.Tensor) -> None:
        self._bucket_buffer(bucket)[offset: offset + grad.numel()].add_(grad)

    def launch(self, bucket: BucketLayout, async_op: bool) -> PendingCollective:
        return self.reduce_to_owner(bucket, self._bucket_buffer(bucket), async_op)

    def complete(self, bucket: BucketLayout) -> None:
        full = self._buffers.pop(bucket.index)
        start, end = bucket.shard_range(self.world.rank)
        received = full[start:end]  # the reduction was in place (see reduce_to_owner)
        self.precision.after_reduction(received, self.data_parallel_size)
        held = self._grad_chunks.get(bucket.index)
        if held is None:  # the first reduction since zero_grad: the chunk is born
            self._grad_chunks[bucket.index] = received.to(self.precision.grad_accum, copy=True)
        else:
            held.add_(received)
        self._bucket_pool.release(full)

    def finish_backward(self) -> None:
        """Give the full-size bucket buffers back once backward is over: they are needed again only when
        the next backward's gradients arrive, and the forward between (the activation peak) should not
        hold them (with DeepSpeed's default bucket size, one bucket is the whole model)."""
        super().finish_backward()
        self._bucket_pool.trim()

    def owned_grad(self, bucket: BucketLayout) -> torch.Tensor:
        held = self._grad_chunks.get(bucket.index)
        if held is None:  # no reduction since zero_grad (a step without backward is refused earlier)
            held = self._grad_chunks[bucket.index] = torch.zeros(
                bucket.shard_numel, dtype=self.precision.grad_accum, device=self.flat.device)
        return held

    def release_grad(self, bucket: BucketLayout) -> None:
        self._grad_chunks.pop(bucket.index, None)

    def zero_grad(self) -> None:
        self._grad_chunks.clear()

    def held_grad_bytes(self) -> int:
        return sum(chunk.untyped_storage().nbytes() for chunk in self._grad_chunks.values())

    def grad_bytes(self) -> tuple[int, int]:
        """The chunks' bytes from the end of backward to the step (see the Note), and their padding."""
        size = self.precision.grad_accum.itemsize
        real = self.owned_real_numel()
        return real * size, (self.layout.shard_numel() - real) * size
