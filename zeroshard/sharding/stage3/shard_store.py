"""Where stage 3 keeps this rank's chunk of each bucket: on the device, in host memory, or on NVMe.

[Note: parameter offload]
Without ``offload_param`` every chunk sits in one device tensor.  With ``device: cpu`` the chunks of
non-persistent buckets sit in host memory (page-locked with ``pin_memory`` when the run trains on a
GPU) and are copied into the device's full buffer only for their all-gather.  With ``device: nvme``
the first chunks, up to ``max_in_cpu`` elements, stay in host memory and the rest live in swap files
(:class:`~zeroshard.offload.param_swap.ParamSwap`).  Persistent buckets are whole on every rank
anyway and stay on the device.  Which bucket goes where is the :class:`OffloadPolicy`'s decision.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...distributed.collectives import Collectives
from ...host.pinned_total import pin_host_tensor
from ...offload.policy import OffloadPolicy, Place, SwapFailure
from ..layout import BucketLayout, FlatLayout, ShardRanks


class ShardStore:
    """This rank's chunks of every bucket, each in its place (device, host or NVMe)."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, persistent: frozenset[int],
                 policy: OffloadPolicy, comm: Collectives) -> None:
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.where = policy.shard_places([b.shard_numel for b in layout.buckets], persistent)
        self._offset: dict[int, int] = {}
        sizes = {Place.DEVICE: 0, Place.HOST: 0}
        for bucket in layout.buckets:
            place = self.where[bucket.index]
            if place in sizes:
                self._offset[bucket.index] = sizes[place]
                sizes[place] += bucket.shard_numel
        self.device_shard = torch.zeros(sizes[Place.DEVICE], dtype=dtype, device=device)  # 1D: own chunks
        self.host_shard = torch.zeros(sizes[Place.HOST], dtype=dtype)
        if policy.pin_memory and comm.world.device_policy.pin_host_memory and sizes[Place.HOST]:
            self.host_shard = pin_host_tensor(self.host_shard)
        self.swap = policy.open_param_swap({b.index: b.shard_numel for b in layout.buckets
                                            if self.where[b.index] is Place.NVME}, dtype, comm)

    # ------------------------------------------------------------------ access
    def view(self, bucket: BucketLayout) -> Optional[torch.Tensor]:
        """The chunk itself when it is resident (device or host), else None."""
        place = self.where[bucket.index]
        if place is Place.NVME:
            return None
        shard = self.device_shard if place is Place.DEVICE else self.host_shard
        start = self._offset[bucket.index]
        return shard[start: start + bucket.shard_numel]

    def read_into(self, bucket: BucketLayout, into: torch.Tensor) -> None:
        """Copy the chunk into ``into`` (the full buffer's own slot, on the device)."""
        resident = self.view(bucket)
        if resident is not None:
            into.copy_(resident, non_blocking=resident.is_pinned())
            return
        assert self.swap is not None
        self.swap.read_into(bucket.index, into)

    def write(self, bucket: BucketLayout, start: int, values: torch.Tensor) -> None:
        """Store ``values`` (any float dtype) at element ``start`` of the chunk, rounded to the shard dtype."""
        resident = self.view(bucket)
        if resident is not None:
            resident[start: start + values.numel()].copy_(values)
            return
        assert self.swap is not None
        self.swap.write(bucket.index, start, values)

    def take_failure(self) -> SwapFailure:
        return self.swap.take_failure() if self.swap is not None else None

    def flush(self) -> None:
        """Wait for every write to NVMe (a failure is kept for :meth:`take_failure`)."""
        if self.swap is not None:
            self.swap.flush()

    def close(self) -> None:
        """Flush and remove the swap files (also done at exit)."""
        if self.swap is not None:
            self.swap.close()

    # ------------------------------------------------------------------ accounting
    def real_numel_at(self, place: Place, ranks: ShardRanks) -> int:
        """Real elements of this rank's trainable chunks kept at ``place`` (frozen buckets are not model
        states: the breakdown counts them under ``frozen_params``)."""
        return sum(b.real_numel_in_shard(ranks.of(b)) for b in self.layout.buckets
                   if self.where[b.index] is place and not b.frozen)
