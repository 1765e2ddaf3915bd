"""ZeRO stage 0: plain data parallelism, with bucketed all-reduces overlapped with backward."""

from __future__ import annotations

import torch

from ..distributed.collectives import PendingCollective
from .full_grads import FullGradientStrategy
from .layout import BucketLayout
from .strategy import StageTraits


class Stage0(FullGradientStrategy):
    """Every rank holds everything; each gradient bucket is averaged with one all-reduce."""

    traits = StageTraits(stage=0, grads_are_sharded=False, owns_whole_buckets=True, forward_communicates=False,
                         gathers_in_passes=False)

    @property
    def averaged_over(self) -> int:
        """Every rank of the world (stage 0 has no shard groups)."""
        return self.world.world_size

    def launch(self, bucket: BucketLayout, async_op: bool) -> PendingCollective:
        return self.comm_of(bucket).all_reduce(self.ready_to_reduce(bucket), f"grad_bucket{bucket.index}",
                                               async_op=async_op)

    def complete(self, bucket: BucketLayout) -> None:
        cast = self.take_cast(bucket)
        if cast is not None:
            self.grad_bucket(bucket).copy_(cast)
            self.cast_pool.release(cast)
        self.precision.after_reduction(self.grad_bucket(bucket), self.world.world_size)

    def owned_param(self, bucket: BucketLayout) -> torch.Tensor:
        return self.storage.bucket_view(bucket)

    def owned_grad(self, bucket: BucketLayout) -> torch.Tensor:
        return self.grad_bucket(bucket)

    def owned_real(self, bucket: BucketLayout) -> int:
        return bucket.numel

    def refresh_bucket(self, bucket: BucketLayout) -> None:
        """Every rank updated the whole bucket identically: nothing to gather."""
