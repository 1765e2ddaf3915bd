"""``zeroshard.accelerator`` (DeepSpeed's ``deepspeed.accelerator``): ``get_accelerator()``."""

from ..compat.accelerator import CPUAccelerator, CUDAAccelerator, get_accelerator

__all__ = ["get_accelerator", "CPUAccelerator", "CUDAAccelerator"]
