"""A full-size flat gradient buffer, shared by stages 0 and 1 (which keep every gradient on every rank)."""

from __future__ import annotations

import torch

from .layout import BucketLayout
from .strategy import ShardingStrategy


class FullGradientStrategy(ShardingStrategy):
    """Gradients accumulate, across micro steps, into one buffer shaped like the flat parameters.

    Communication happens only at the accumulation boundary (``sync_gradients``), so accumulating
    over K micro steps costs one reduction, exactly like ``DistributedDataParallel.no_sync``.
    """

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.grads = torch.zeros_like(self.flat.data)  # 1D, padded, same layout as the parameters

    def store_grad(self, bucket: BucketLayout, offset: int, grad: torch.Tensor) -> None:
        start = bucket.offset + offset
        self.grads[start: start + grad.numel()].add_(grad)

    def grad_bucket(self, bucket: BucketLayout) -> torch.Tensor:
        return self.grads[bucket.offset: bucket.offset + bucket.padded_numel]

    def zero_grad(self) -> None:
        self.grads.zero_()

    def grad_bytes(self) -> tuple[int, int]:
        size = self.grads.element_size()
        return self.layout.numel * size, (self.layout.padded_numel - self.layout.numel) * size
