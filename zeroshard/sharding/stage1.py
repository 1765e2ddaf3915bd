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
    defers_refresh = True

    def launch(self, bucket: BucketLayout, async_op: bool) -> PendingCollective:
        full = self.to_comm_dtype(bucket)
        if self.zero.reduce_scatter and full.data_ptr() == self.grad_bucket(bucket).data_ptr():
            # In place: this rank's averaged chunk lands in its own chunk of the full-size gradient, which
            # the rest of the bucket no longer needs (NCCL documents this form; gloo reads its inputs
            # first), so no shard-size buffer is held beside the full-size one.
            self.precision.before_reduction(full, self.data_parallel_size)
            start, end = bucket.shard_range(self.world.rank)
            return self.comm.reduce_scatter(full[start:end], full, f"grad_bucket{bucket.index}", async_op=async_op)
        return self.reduce_to_owner(bucket, full, async_op)

    def complete(self, bucket: BucketLayout) -> None:
        # The chunk of the full buffer that this rank keeps is overwritten by the reduced result.
        received = self.take_received(bucket)
        cast = self.take_cast(bucket)
        if received is not None:
            self.owned_grad(bucket).copy_(received)
            self.shard_pool.release(received)
        elif cast is not None:  # all-reduced in the communication dtype: keep the own chunk
            start, end = bucket.shard_range(self.world.rank)
            self.owned_grad(bucket).copy_(cast[start:end])
        if cast is not None:
            self.cast_pool.release(cast)
        self.precision.after_reduction(self.owned_grad(bucket), self.data_parallel_size)

    def owned_grad(self, bucket: BucketLayout) -> torch.Tensor:
        start, end = bucket.shard_range(self.world.rank)
        return self.grad_bucket(bucket)[start:end]
