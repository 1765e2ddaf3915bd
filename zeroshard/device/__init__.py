"""The device: what a run asks of the device it trains on (policy.py: :class:`DevicePolicy`, held by
the world, see [Note: the device decided once] in device/policy.py), and the process's accelerator
under DeepSpeed's names (accelerator.py: ``get_accelerator``)."""

from .accelerator import get_accelerator
from .policy import CUDADevice, DevicePolicy, HostDevice, device_policy

__all__ = ["DevicePolicy", "HostDevice", "CUDADevice", "device_policy", "get_accelerator"]
