"""ZeRO stage 1: optimizer state sharded; gradients stay full-size until the boundary reduction."""

from __future__ import annotations

import torch

from ..distributed.collectives import PendingCollective
from .full_grads import FullGradientStrategy
from .layout import BucketLayout


class Stage1(FullGradientStrategy):
    """Each rank's optimizer holds and updates only its chunk of every bucket (8Ψ/N of Adam state).

    At the boundary each bucket is reduce-scattered so that a rank receives the averaged gradient of
    its own chunk only (``reduce_scatter: false`` all-reduces instead and keeps the chunk).  After the
    step the updated chunks are all-gathered back into every rank's full parameters.
    """

    stage = 1

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._received: dict[int, torch.Tensor] = {}  # bucket index -> this rank's reduced chunk

    def launch(self, bucket: BucketLayout, async_op: bool) -> PendingCollective:
        full = self.grad_bucket(bucket)
        full.div_(self.world.world_size)
        label = f"grad_bucket{bucket.index}"
        if not self.zero.reduce_scatter:
            return self.comm.all_reduce(full, label, async_op=async_op)
        # The chunk of ``full`` that this rank keeps is overwritten by the result in complete().
        out = self.shard_pool.acquire(bucket.shard_numel)
        self._received[bucket.index] = out
        return self.comm.reduce_scatter(out, full, label, async_op=async_op)

    def complete(self, bucket: BucketLayout) -> None:
        received = self._received.pop(bucket.index, None)
        if received is not None:
            self.owned_grad(bucket).copy_(received)
            self.shard_pool.release(received)

    def owned_grad(self, bucket: BucketLayout) -> torch.Tensor:
        start, end = bucket.shard_range(self.world.rank)
        return self.grad_bucket(bucket)[start:end]
