"""ZeRO stage 1: optimizer state sharded; gradients stay full-size until the boundary reduction."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.collectives import PendingCollective
from .full_grads import FullGradientStrategy
from .layout import BucketLayout
from .strategy import StageTraits


class Stage1(FullGradientStrategy):
    """Each rank's optimizer holds and updates only its chunk of every bucket (8Ψ/N of Adam state).

    At the boundary each bucket is reduce-scattered so that a rank receives the averaged gradient of
    its own chunk only (``reduce_scatter: false`` all-reduces instead and keeps the chunk).  After the
    step the updated chunks are all-gathered back into every rank's full parameters.
    """

    traits = StageTraits(stage=1, grads_are_sharded=True, owns_whole_buckets=False, forward_communicates=False,
                         gathers_in_passes=False, needs_optimizer=True)

    def hook_model(self, model: nn.Module) -> None:
        """With ``overlap_param_gather``, the post-step gather runs on into the next forward ([Note: the
        parameter gather runs into the next forward] in sharding/strategy.py)."""
        if self.zero.overlap_param_gather:
            self.defer_refresh_to_forward(model)

    def launch(self, bucket: BucketLayout, async_op: bool) -> PendingCollective:
        return self.reduce_to_owner(bucket, self.ready_to_reduce(bucket), async_op)

    def complete(self, bucket: BucketLayout) -> None:
        # The averaged chunk is in this rank's chunk of what was reduced: the gradient bucket itself, or
        # its copy in the communication dtype, which is read back into it.
        cast = self.take_cast(bucket)
        if cast is not None:
            start, end = bucket.shard_range(self.ranks.of(bucket))
            self.owned_grad(bucket).copy_(cast[start:end])
            self.cast_pool.release(cast)
        self.precision.after_reduction(self.owned_grad(bucket), self.data_parallel_size)

    def owned_grad(self, bucket: BucketLayout) -> torch.Tensor:
        start, end = bucket.shard_range(self.ranks.of(bucket))
        return self.grad_bucket(bucket)[start:end]
