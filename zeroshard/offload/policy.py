"""Where training state lives, as types: on the training device, in host memory, or on NVMe.

The config says ``offload_optimizer.device`` / ``offload_param.device`` as strings; this module turns
each block, once, into an :class:`OffloadPolicy` value, and from then on code asks the policy instead
of comparing strings.  Two kinds of state are placed by a policy:

- the optimizer's fp32 masters and state (:func:`optimizer_offload`; the updater that matches the
  policy, in ``optim/updaters.py``, owns how a piece is read, stepped and written);
- stage 3's parameter shards (:func:`param_offload`; ``sharding/stage3/shard_store.py`` asks the policy
  where each bucket's shard goes and for its swap space).

The policy is the only thing ``sharding/`` knows about offload: the swap machinery it opens stays in
this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, ClassVar, Optional, Sequence

import torch

from ..config.schema import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from .master_swap import MasterSwap
from .param_swap import ParamSwap
from .swap_files import OffloadIOError

#: what a part that swaps hands back when asked for its failure (see [Note: swap failures stop every
#: rank together] in offload/swap_files.py)
SwapFailure = Optional[OffloadIOError]

if TYPE_CHECKING:
    from ..distributed.collectives import Collectives


class Place(Enum):
    """Where one piece of state is kept."""

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"


@dataclass(frozen=True)
class OffloadPolicy:
    """Keep state on the training device (no offload): the base of the variants below."""

    #: where the optimizer's values and state (or the parameter shards) live
    place: ClassVar[Place] = Place.DEVICE
    #: whether fp32 masters exist even for fp32 training (the optimizer then steps copies, not the params)
    needs_masters: ClassVar[bool] = False
    pin_memory: bool = False

    def masters_device(self, device: torch.device) -> torch.device:
        """Where the fp32 masters (and the optimizer's state) are allocated."""
        return device

    def open_master_swap(self, spans: Sequence[tuple[int, int]], sub_group_size: int,
                         comm: "Collectives") -> Optional[MasterSwap]:
        """The swap files the masters go to (NVMe only; None: the masters are in memory)."""
        return None

    def shard_places(self, shard_numels: Sequence[int], persistent: frozenset[int]) -> list[Place]:
        """Stage 3: where each bucket's shard lives (persistent buckets stay on the device)."""
        return [Place.DEVICE for _ in shard_numels]

    def open_param_swap(self, shard_numels: dict[int, int], dtype: torch.dtype,
                        comm: "Collectives") -> Optional[ParamSwap]:
        """Stage 3: the swap files of the shards :meth:`shard_places` put on NVMe (None without any)."""
        return None


NoOffload = OffloadPolicy


@dataclass(frozen=True)
class HostOffload(OffloadPolicy):
    """Host memory (ZeRO-Offload): the optimizer steps there in sub-groups of ``sub_group_size``."""

    place: ClassVar[Place] = Place.HOST
    needs_masters: ClassVar[bool] = True

    def masters_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu")

    def shard_places(self, shard_numels: Sequence[int], persistent: frozenset[int]) -> list[Place]:
        return [Place.DEVICE if i in persistent else Place.HOST for i in range(len(shard_numels))]


@dataclass(frozen=True)
class NVMeOffload(HostOffload):
    """Files under ``directory`` (ZeRO-Infinity), a few pieces in host memory at a time."""

    place: ClassVar[Place] = Place.NVME
    directory: str = ""
    config_key: str = ""  # the config key that names the directory, for errors
    buffer_count: int = 4
    buffer_size: int = 0  # parameter shards: elements of one staging buffer
    max_in_cpu: int = 0  # parameter shards: elements kept in host memory before the rest go to files

    def open_master_swap(self, spans: Sequence[tuple[int, int]], sub_group_size: int,
                         comm: "Collectives") -> Optional[MasterSwap]:
        return MasterSwap(list(spans), self.directory, self.config_key, self.buffer_count, sub_group_size, comm)

    def shard_places(self, shard_numels: Sequence[int], persistent: frozenset[int]) -> list[Place]:
        places, in_host = [], 0
        for i, numel in enumerate(shard_numels):
            if i in persistent:
                places.append(Place.DEVICE)
            elif in_host + numel <= self.max_in_cpu:
                places.append(Place.HOST)
                in_host += numel
            else:
                places.append(Place.NVME)
        return places

    def open_param_swap(self, shard_numels: dict[int, int], dtype: torch.dtype,
                        comm: "Collectives") -> Optional[ParamSwap]:
        if not shard_numels:
            return None
        return ParamSwap(shard_numels, dtype, self.directory, self.config_key, self.buffer_count,
                         self.buffer_size, comm)


def optimizer_offload(zero: ZeroConfig) -> OffloadPolicy:
    """The policy of ``zero_optimization.offload_optimizer``."""
    block: OffloadOptimizerConfig = zero.offload_optimizer
    if block.device == "cpu":
        return HostOffload(block.pin_memory)
    if block.device == "nvme":
        return NVMeOffload(block.pin_memory, block.nvme_directory, "zero_optimization.offload_optimizer.nvme_path",
                           block.buffer_count)
    return NoOffload()


def param_offload(zero: ZeroConfig) -> OffloadPolicy:
    """The policy of ``zero_optimization.offload_param`` (stage 3's parameter shards)."""
    block: OffloadParamConfig = zero.offload_param
    if block.device == "cpu":
        return HostOffload(block.pin_memory)
    if block.device == "nvme":
        return NVMeOffload(block.pin_memory, block.nvme_directory, "zero_optimization.offload_param.nvme_path",
                           block.buffer_count, block.buffer_size, block.max_in_cpu)
    return NoOffload()


@dataclass(frozen=True)
class OffloadPolicies:
    """The two placements a config chooses: the optimizer's (masters and state) and stage 3's parameters'."""

    optimizer: OffloadPolicy = NoOffload()
    params: OffloadPolicy = NoOffload()
    sub_group_size: int = 1_000_000_000  # elements the host/NVMe optimizer steps at once

    @staticmethod
    def from_config(zero: ZeroConfig) -> "OffloadPolicies":
        return OffloadPolicies(optimizer_offload(zero), param_offload(zero), zero.sub_group_size)

    @property
    def optimizer_on_host(self) -> bool:
        """Whether the optimizer steps host memory (its state in host memory or swapped to NVMe)."""
        return self.optimizer.place != Place.DEVICE

    @property
    def uses_nvme(self) -> bool:
        return Place.NVME in (self.optimizer.place, self.params.place)
