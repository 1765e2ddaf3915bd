"""Host offload (ZeRO-Offload): masters and optimizer state in host memory, stepped in sub-groups.

As each bucket's gradients are averaged at a boundary, its owned chunk is copied to a host fp32
buffer (from a GPU asynchronously, into page-locked memory) while backward goes on; the optimizer
then steps the host pieces (at most ``sub_group_size`` elements each, see [Note: cutting pieces] in
offload/master_swap.py) and publishes each into the parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..offload.master_swap import split_pieces
from ..offload.policy import Place
from ..sharding.layout import BucketLayout
from .updater import MasterUpdater

if TYPE_CHECKING:
    from ..sharding.strategy import ShardingStrategy


class HostUpdater(MasterUpdater):
    """fp32 masters and optimizer state in host memory; gradients copied there as they are reduced."""

    place = Place.HOST

    def __init__(self, strategy: "ShardingStrategy", sub_group_size: int) -> None:
        self.sub_group_size = sub_group_size
        super().__init__(strategy)
        masters = self.master_weights.data
        # filled as buckets are reduced; page-locked whenever gradients come from a GPU (``pin_memory``
        # decides for the masters and optimizer state): a pageable target would make every bucket's copy
        # wait for the GPU, inside backward
        self.device_policy = strategy.world.device_policy
        pinned = masters.is_pinned() or self.device_policy.pin_host_memory
        self.host_grads = torch.zeros(masters.numel(), dtype=torch.float32, pin_memory=pinned)
        self._copies: list[Any] = []  # the device's events

    def spans(self, numel: int) -> list[tuple[int, int]]:
        return split_pieces(numel, self.sub_group_size)

    def grad_reduced(self, bucket: BucketLayout) -> None:
        """Copy the bucket's averaged owned gradient to host memory as soon as it is reduced."""
        target = self.master_weights.view_of(self.host_grads, bucket)
        source = self.strategy.owned_grad(bucket)
        target.copy_(source, non_blocking=target.is_pinned())
        # on the stream backward ran on: waited for in step_grads (the source is on the run's device)
        event = self.device_policy.record_event() if target.is_pinned() else None
        if event is not None:
            self._copies.append(event)

    def step_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The host copies, once the non-blocking device-to-host copies have landed."""
        for event in self._copies:
            event.synchronize()
        self._copies = []
        return [self.master_weights.view_of(self.host_grads, b) for b in self.layout.buckets]

    def host_buffer_bytes(self) -> int:
        return self.host_grads.numel() * 4
