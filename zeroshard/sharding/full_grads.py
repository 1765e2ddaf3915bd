"""A full-size flat gradient buffer, shared by stages 0 and 1 (which keep every gradient on every rank)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from ..config import ZeroConfig
from ..distributed.topology import ShardGroups
from ..precision import PrecisionPolicy
from .buffer_pool import BufferPool
from .layout import BucketLayout, ParamSlot
from .flat_params import FlatParameters
from .strategy import ShardingStrategy


class FullGradientStrategy(ShardingStrategy):
    """Gradients accumulate, across micro steps, into full-size buckets shaped like the flat parameters.

    Communication happens only at the accumulation boundary (``sync_gradients``), so accumulating
    over K micro steps costs one reduction, exactly like ``DistributedDataParallel.no_sync``.  The
    buffer is kept from step to step (see [Note: gradients live from backward to the step] in
    sharding/strategy.py for why stages 0-1 differ from 2-3 here).

    [Note: a full gradient buffer zeroed where it was not written]
    ``zero_grad()`` does not write the buffer: it forgets which parameters were stored since the
    last one.  The first gradient of a parameter after it is copied into its slot, later ones (the
    next micro steps) are added, and before a bucket is reduced the slots nothing was stored in and
    the padding are zeroed.  A gradient stored first in the backward that reduces it (every one,
    without accumulation) is divided by the number of ranks on its way in, and the others are
    divided slot by slot before the reduction, so each element is divided once, as
    ``PrecisionPolicy.before_reduction`` on the whole bucket would (bit for bit; when the bucket is
    reduced in another dtype, its cast copy is divided whole).  Zeroing the whole buffer after every
    step, adding each gradient into the zeros and dividing the whole bucket would be two more passes
    over every gradient and a second read of it, on the training thread (as [Note: filling a stage-2
    bucket] in sharding/sharded_grads.py).
    """

    @property
    def averaged_over(self) -> int:
        """The number of ranks a gradient is averaged over."""
        return self.data_parallel_size

    def __init__(self, storage: FlatParameters, params: Sequence[nn.Parameter], groups: ShardGroups,
                 zero: ZeroConfig, precision: PrecisionPolicy = PrecisionPolicy()) -> None:
        super().__init__(storage, params, groups, zero, precision)
        # 1D, padded, same layout as the parameters, in the accumulation dtype
        self.grads = torch.zeros(self.layout.padded_numel, dtype=self.precision.grad_accum, device=self.storage.device)
        #: parameters (by index) whose slot holds a gradient stored since the last ``zero_grad()``, and
        #: those of them already divided for the reduction (see the Note)
        self._stored: set[int] = set()
        self._divided: set[int] = set()
        #: whether gradients are reduced in the dtype they are held in (else a divided cast copy is)
        self._divides_in_place = self.precision.grad_accum == self.precision.comm
        largest = max(b.padded_numel for b in self.layout.buckets)
        #: buckets converted to the communication dtype while in flight (only when it differs)
        self.cast_pool = BufferPool(largest, self.precision.comm, self.storage.device, self.storage.buffer_memory)
        self._cast: dict[int, torch.Tensor] = {}

    def communicates_now(self) -> bool:
        """Only at the accumulation boundary (``sync_gradients``)."""
        return self.sync_gradients

    def ready_to_reduce(self, bucket: BucketLayout) -> torch.Tensor:
        """The bucket's gradients as its reduction sums them: zeros where nothing was stored, divided
        for the average (see the Note), in the communication dtype: the bucket itself, or a pooled
        copy (bf16 training with accumulation holds fp32 gradients and communicates in bf16 by default)."""
        grads = self.grad_bucket(bucket)
        bucket.zero_unwritten(grads, self._stored)  # the padding too: a reduce-scatter leaves partial sums
        if self._divides_in_place:
            for slot in bucket.slots:
                if slot.index in self._stored and slot.index not in self._divided:
                    self.precision.before_reduction(grads[slot.offset: slot.offset + slot.numel],
                                                    self.averaged_over)
            return grads
        cast = self.cast_pool.acquire(bucket.padded_numel)
        cast.copy_(grads)
        self.precision.before_reduction(cast, self.averaged_over)
        self._cast[bucket.index] = cast
        return cast

    def take_cast(self, bucket: BucketLayout) -> Optional[torch.Tensor]:
        """The pooled copy made by :meth:`ready_to_reduce` (give it back with ``cast_pool.release``)."""
        return self._cast.pop(bucket.index, None)

    def comm_buffer_bytes(self) -> int:
        return self.cast_pool.nbytes + super().comm_buffer_bytes()

    def store_grad(self, bucket: BucketLayout, slot: ParamSlot, grad: torch.Tensor, first: bool) -> None:
        """See [Note: a full gradient buffer zeroed where it was not written]."""
        start = bucket.offset + slot.offset
        into = self.grads[start: start + slot.numel]
        index = slot.index
        if index in self._divided:  # a second gradient in one backward (reentrant checkpointing)
            self.precision.store_divided(into, grad, self.averaged_over, accumulate=True)
        elif index in self._stored:
            into.add_(grad)
        elif self.sync_gradients and self._divides_in_place:  # stored and reduced in this backward
            self.precision.store_divided(into, grad, self.averaged_over, accumulate=False)
            self._stored.add(index)
            self._divided.add(index)
        else:
            into.copy_(grad)
            self._stored.add(index)

    def grad_bucket(self, bucket: BucketLayout) -> torch.Tensor:
        return self.grads[bucket.offset: bucket.offset + bucket.padded_numel]

    def release_grad(self, bucket: BucketLayout) -> None:
        """Kept: forgotten by :meth:`zero_grad` after the step."""

    def zero_grad(self) -> None:
        self._stored.clear()  # see [Note: a full gradient buffer zeroed where it was not written]
        self._divided.clear()

    def held_grad_bytes(self) -> int:
        return self.grads.untyped_storage().nbytes()

    def grad_bytes(self) -> tuple[int, int]:
        size = self.grads.element_size()
        return self.layout.numel * size, (self.layout.padded_numel - self.layout.numel) * size
