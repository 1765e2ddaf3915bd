"""``deepspeed.accelerator``: ``get_accelerator()`` and DeepSpeed's accelerator classes, which are the
core's (``zeroshard/device/accelerator.py``: one object per process, the same whichever path imports it)."""

from __future__ import annotations

from ..device.accelerator import (SUPPORTED_ACCELERATOR_LIST, CPUAccelerator, CUDAAccelerator, get_accelerator,
                                  is_current_accelerator_supported)

__all__ = ["get_accelerator", "is_current_accelerator_supported", "SUPPORTED_ACCELERATOR_LIST", "CPUAccelerator",
           "CUDAAccelerator"]
