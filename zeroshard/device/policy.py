"""What the parts of a run ask of the device it trains on, as one typed policy chosen with the device.

[Note: the device decided once]
Which device a rank trains on is decided once, when its :class:`~zeroshard.distributed.world.World` is
made ([Note: which device a rank trains on] in distributed/world.py).  What follows from that choice
(whether host buffers that exchange values with the device are page-locked, how to wait for it, how
to know when a queued copy has run, its peak memory, its random generator) is one
:class:`DevicePolicy`, which the world holds (``world.device_policy``) and every part asks, rather
than each part testing ``device.type`` or ``torch.cuda.is_available()`` again.  The process's CUDA
is not the run's device: a gloo world on a GPU host trains on the CPU, and page-locks nothing for a
GPU it never copies to.  A question about one tensor's own placement (is this tensor in host memory?)
stays with the tensor: a run's state can sit on the device and in host memory at once (offload), so
only the tensor can answer it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

__all__ = ["DevicePolicy", "HostDevice", "CUDADevice", "device_policy"]


@dataclass(frozen=True)
class DevicePolicy(ABC):
    """The device a run trains on, and the answers that follow from its kind (see [Note: the device
    decided once])."""

    device: torch.device
    #: whether the device runs kernels queued on streams, asynchronously to the host (a GPU); False:
    #: every operation has finished when it returns
    is_accelerator: ClassVar[bool]

    @property
    def pin_host_memory(self) -> bool:
        """Whether host buffers that values travel through to and from the device are page-locked, so
        that those copies do not wait (``non_blocking``): only where there is a device to copy to."""
        return self.is_accelerator

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until everything queued on the device has run."""

    @abstractmethod
    def record_event(self) -> Optional[Any]:
        """An event recorded now on the current stream, to wait for what is queued before it (a copy
        that does not wait); None where work is synchronous and there is nothing to wait for."""

    @abstractmethod
    def peak_bytes(self) -> int:
        """The device memory allocated at most so far (0 on the host, whose peak is the process's)."""

    @abstractmethod
    def rng_state(self) -> torch.Tensor:
        """The state of the random generator the device draws from."""

    @abstractmethod
    def set_rng_state(self, state: torch.Tensor) -> None:
        """Put back a state :meth:`rng_state` returned."""


@dataclass(frozen=True)
class HostDevice(DevicePolicy):
    """Training on the CPU: synchronous, nothing page-locked, no events."""

    is_accelerator: ClassVar[bool] = False

    def synchronize(self) -> None:
        """CPU work is synchronous."""

    def record_event(self) -> Optional[Any]:
        return None

    def peak_bytes(self) -> int:
        return 0

    def rng_state(self) -> torch.Tensor:
        """torch's CPU generator (the process's)."""
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)


@dataclass(frozen=True)
class CUDADevice(DevicePolicy):
    """Training on a CUDA GPU: streams, events, page-locked host buffers, the device's own generator."""

    is_accelerator: ClassVar[bool] = True

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def record_event(self) -> Optional[Any]:
        event = torch.cuda.Event()
        event.record()
        return event

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state, self.device)


def device_policy(device: torch.device) -> DevicePolicy:
    """The policy of ``device``: CUDA's for a CUDA device, the host's otherwise."""
    return CUDADevice(device) if device.type == "cuda" else HostDevice(device)
