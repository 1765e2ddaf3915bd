"""Choosing the updater: the offload policy and the precision decide, once, where the optimizer steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..offload.policy import HostOffload, NVMeOffload, OffloadPolicies
from .host_updater import HostUpdater
from .nvme_updater import NVMeUpdater
from .updater import MasterUpdater, ParamUpdater, ShardUpdater

if TYPE_CHECKING:
    from ..sharding.strategy import ShardingStrategy


def build_updater(strategy: "ShardingStrategy", offload: OffloadPolicies) -> ShardUpdater:
    """NVMe, host, fp32 masters on the device (mixed precision), or the parameters themselves."""
    if isinstance(offload.optimizer, NVMeOffload):
        return NVMeUpdater(strategy)
    if isinstance(offload.optimizer, HostOffload):
        return HostUpdater(strategy, offload.sub_group_size)
    if strategy.masters is not None:
        return MasterUpdater(strategy)
    return ParamUpdater(strategy)
