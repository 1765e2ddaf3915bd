"""``deepspeed.runtime.zero.offload_config``: the offload blocks' classes (read-only views of zeroshard's
schema, deepspeed/runtime/zero/config.py) and ``OffloadDeviceEnum``, the devices their ``device`` names."""

from __future__ import annotations

from enum import Enum

from .config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig

__all__ = ["OffloadDeviceEnum", "DeepSpeedZeroOffloadParamConfig", "DeepSpeedZeroOffloadOptimizerConfig"]


class OffloadDeviceEnum(str, Enum):
    """Where an offload block puts its state: ``none``, ``cpu`` or ``nvme`` (the schema's values)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"
