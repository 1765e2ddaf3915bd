"""ZeRO stage 2: gradients sharded too: each bucket is reduce-scattered as backward fills it."""

from __future__ import annotations

import torch

from ..distributed.collectives import PendingCollective
from .layout import BucketLayout
from .strategy import ShardingStrategy


class Stage2(ShardingStrategy):
    """Only this rank's gradient chunks persist (4Ψ/N); full-size buckets live only while in flight.

    [Note: stage-2 accumulation]
    Gradients are reduced at every micro step (there is nowhere to keep a full-size gradient between
    micro steps) and the averaged chunks are added into a persistent shard accumulator.  Under
    accumulation this communicates K times per optimizer step where stage 1 communicates once: the
    price of holding 4Ψ/N instead of 4Ψ of gradients, as in DeepSpeed.
    """

    stage = 2
    reduces_every_micro_step = True

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.grad_shard = torch.zeros(self.layout.shard_numel(), dtype=self.flat.dtype,
                                      device=self.flat.device)  # 1D: this rank's chunk of each bucket
        self._shard_offset = {}
        offset = 0
        for bucket in self.layout.buckets:
            self._shard_offset[bucket.index] = offset
            offset += bucket.shard_numel
        self._buffers: dict[int, torch.Tensor] = {}  # bucket index -> full bucket in flight
        self._received: dict[int, torch.Tensor] = {}
        self.peak_bucket_bytes = 0

    def _bucket_buffer(self, bucket: BucketLayout) -> torch.Tensor:
        buffer = self._buffers.get(bucket.index)
        if buffer is None:
            buffer = torch.zeros(bucket.padded_numel, dtype=self.flat.dtype, device=self.flat.device)
            self._buffers[bucket.index] = buffer
            live = sum(b.numel() * b.element_size() for b in self._buffers.values())
            self.peak_bucket_bytes = max(self.peak_bucket_bytes, live)
        return buffer

    def store_grad(self, bucket: BucketLayout, offset: int, grad: torch.Tensor) -> None:
        self._bucket_buffer(bucket)[offset: offset + grad.numel()].add_(grad)

    def launch(self, bucket: BucketLayout, async_op: bool) -> PendingCollective:
        full = self._bucket_buffer(bucket)
        full.div_(self.world.world_size)
        label = f"grad_bucket{bucket.index}"
        if not self.zero.reduce_scatter:
            return self.comm.all_reduce(full, label, async_op=async_op)
        out = torch.empty(bucket.shard_numel, dtype=full.dtype, device=full.device)
        self._received[bucket.index] = out
        return self.comm.reduce_scatter(out, full, label, async_op=async_op)

    def complete(self, bucket: BucketLayout) -> None:
        full = self._buffers.pop(bucket.index)
        received = self._received.pop(bucket.index, None)
        if received is None:
            start, end = bucket.shard_range(self.world.rank)
            received = full[start:end]
        self.owned_grad(bucket).add_(received)

    def owned_grad(self, bucket: BucketLayout) -> torch.Tensor:
        start = self._shard_offset[bucket.index]
        return self.grad_shard[start: start + bucket.shard_numel]

    def zero_grad(self) -> None:
        self.grad_shard.zero_()

    def grad_bytes(self) -> tuple[int, int]:
        size = self.grad_shard.element_size()
        real = self.owned_real_numel()
        return real * size, (self.grad_shard.numel() - real) * size
