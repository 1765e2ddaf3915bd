"""``deepspeed.runtime.zero.config``: ``DeepSpeedZeroConfig``, a read-only view of zeroshard's
``zero_optimization`` block under DeepSpeed's field names, and ``ZeroStageEnum`` (see [Note: DeepSpeed's
config classes as views] in deepspeed/runtime/config.py)."""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Optional

from ....config.deepspeed_forms import DEFAULTS_THAT_MATCH
from ....config.loader import load_config
from ....config.schema import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from ..config_utils import BlockView

__all__ = ["DeepSpeedZeroConfig", "ZeroStageEnum"]


class ZeroStageEnum(IntEnum):
    """The ZeRO stages by DeepSpeed's names (an ``int``: ``ZeroStageEnum.weights == 3``)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


#: DeepSpeed's field name -> zeroshard's key, where they differ (DeepSpeed accepts the key as an alias)
_RENAMED = {"prefetch_bucket_size": "stage3_prefetch_bucket_size",
            "param_persistence_threshold": "stage3_param_persistence_threshold",
            "max_live_parameters": "stage3_max_live_parameters",
            "max_reuse_distance": "stage3_max_reuse_distance",
            "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save"}
#: DeepSpeed's fields for keys zeroshard drops when they state the default (config/deepspeed_forms.py)
_DEFAULTS = {name.removeprefix("stage3_"): value for name, value in DEFAULTS_THAT_MATCH["zero_optimization"].items()}


class DeepSpeedZeroConfig(BlockView):
    """``zero_optimization`` under DeepSpeed's names.  ``DeepSpeedZeroConfig(stage=3, prefetch_bucket_size=...)``
    parses the fields (DeepSpeed's names or the JSON keys) as the config loader does; every attribute reads
    the parsed block.  ``offload_param`` / ``offload_optimizer`` are None when nothing is offloaded, as
    DeepSpeed leaves them without the block, else zeroshard's block (``device``, ``nvme_path``,
    ``pin_memory``, ``buffer_count``, ...)."""

    __slots__ = ()
    _block: ZeroConfig

    def __init__(self, **fields: Any) -> None:
        raw = {_RENAMED.get(name, name): value for name, value in fields.items()}
        super().__init__(load_config({"zero_optimization": raw}).zero_optimization)

    @property
    def stage(self) -> ZeroStageEnum:
        return ZeroStageEnum(self._block.stage)

    @property
    def offload_param(self) -> Optional[OffloadParamConfig]:
        block = self._block.offload_param
        return None if block.device == "none" else block

    @property
    def offload_optimizer(self) -> Optional[OffloadOptimizerConfig]:
        block = self._block.offload_optimizer
        return None if block.device == "none" else block

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _DEFAULTS:
            return _DEFAULTS[name]
        return getattr(self._block, _RENAMED.get(name, name))

