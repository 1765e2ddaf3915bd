"""Offload: the optimizer's fp32 state (and stage 3's parameter shards) in host memory or on NVMe."""

from .preflight import OffloadPreflightError, preflight_nvme
from .swap_files import OffloadIOError, SwapDirectory, SwapFile, SwapIO

__all__ = ["OffloadIOError", "OffloadPreflightError", "SwapDirectory", "SwapFile", "SwapIO", "preflight_nvme"]
