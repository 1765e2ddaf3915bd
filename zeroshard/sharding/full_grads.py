"""A full-size flat gradient buffer, shared by stages 0 and 1 (which keep every gradient on every rank)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from ..config import ZeroConfig
from ..distributed.topology import ShardGroups
from ..precision import PrecisionPolicy
from .buffer_pool import BufferPool
from .layout import BucketLayout
from .storage import ParameterStorage
from .strategy import ShardingStrategy


class FullGradientStrategy(ShardingStrategy):
    """Gradients accumulate, across micro steps, into full-size buckets shaped like the flat parameters.

    Communication happens only at the accumulation boundary (``sync_gradients``), so accumulating
    over K micro steps costs one reduction, exactly like ``DistributedDataParallel.no_sync``.  The
    buffer is kept from step to step (zeroed, not freed: see [Note: gradients live from backward to
    the step] in strategy.py for why stages 0-1 differ from 2-3 here).
    """

    def __init__(self, flat: ParameterStorage, params: Sequence[nn.Parameter], groups: ShardGroups,
                 zero: ZeroConfig, precision: PrecisionPolicy = PrecisionPolicy()) -> None:
        super().__init__(flat, params, groups, zero, precision)
        # 1D, padded, same layout as the parameters, in the accumulation dtype
        self.grads = torch.zeros(self.layout.padded_numel, dtype=self.precision.grad_accum, device=self.flat.device)
        largest = max(b.padded_numel for b in self.layout.buckets)
        #: buckets converted to the communication dtype while in flight (only when it differs)
        self.cast_pool = BufferPool(largest, self.precision.comm, self.flat.device)
        self._cast: dict[int, torch.Tensor] = {}

    def to_comm_dtype(self, bucket: BucketLayout) -> torch.Tensor:
        """The bucket's gradients in the communication dtype: the bucket itself, or a pooled copy
        (bf16 training with accumulation holds fp32 gradients and communicates in bf16 by default)."""
        grads = self.grad_bucket(bucket)
        if grads.dtype == self.precision.comm:
            return grads
        cast = self.cast_pool.acquire(bucket.padded_numel)
        cast.copy_(grads)
        self._cast[bucket.index] = cast
        return cast

    def take_cast(self, bucket: BucketLayout) -> Optional[torch.Tensor]:
        """The pooled copy made by :meth:`to_comm_dtype` (give it back with ``cast_pool.release``)."""
        return self._cast.pop(bucket.index, None)

    def comm_buffer_bytes(self) -> int:
        return self.cast_pool.nbytes + super().comm_buffer_bytes()

    def store_grad(self, bucket: BucketLayout, offset: int, grad: torch.Tensor) -> None:
        start = bucket.offset + offset
        self.grads[start: start + grad.numel()].add_(grad)

    def grad_bucket(self, bucket: BucketLayout) -> torch.Tensor:
        return self.grads[bucket.offset: bucket.offset + bucket.padded_numel]

    def release_grad(self, bucket: BucketLayout) -> None:
        """Kept: zeroed by :meth:`zero_grad` after the step."""

    def zero_grad(self) -> None:
        self.grads.zero_()

    def held_grad_bytes(self) -> int:
        return self.grads.untyped_storage().nbytes()

    def grad_bytes(self) -> tuple[int, int]:
        size = self.grads.element_size()
        return self.layout.numel * size, (self.layout.padded_numel - self.layout.numel) * size
