"""``deepspeed.runtime.zero.config``: ``DeepSpeedZeroConfig``, a read-only view of zeroshard's
``zero_optimization`` block under DeepSpeed's field names, and ``ZeroStageEnum`` (see [Note: DeepSpeed's
config classes as views] in deepspeed/runtime/config.py)."""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Optional

from ....config.deepspeed_forms import DEFAULTS_THAT_MATCH
from ....config.loader import load_zero_block
from ....config.schema import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from ..config_utils import BlockView
from .leaf_module_config import DeepSpeedZeroLeafModuleConfig

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadParamConfig", "DeepSpeedZeroOffloadOptimizerConfig",
           "ZeroStageEnum"]


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


class _OffloadView(BlockView):
    """An offload block under DeepSpeed's class name: made from keyword arguments (``device``, ``nvme_path``,
    ``pin_memory``, ``buffer_count``, ...) through the loader, every attribute read from the parsed block."""

    __slots__ = ()
    _KEY = ""

    def __init__(self, **fields: Any) -> None:
        super().__init__(getattr(load_zero_block({self._KEY: fields}), self._KEY))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._block, name)


class DeepSpeedZeroOffloadParamConfig(_OffloadView):
    """``zero_optimization.offload_param``."""

    __slots__ = ()
    _KEY = "offload_param"


class DeepSpeedZeroOffloadOptimizerConfig(_OffloadView):
    """``zero_optimization.offload_optimizer``."""

    __slots__ = ()
    _KEY = "offload_optimizer"


class DeepSpeedZeroConfig(BlockView):
    """``zero_optimization`` under DeepSpeed's names.  ``DeepSpeedZeroConfig(stage=3, prefetch_bucket_size=...)``
    parses the block's fields (DeepSpeed's names, the JSON keys or their deprecated forms) as the config loader
    does, as DeepSpeed's class parses them: alone, the rules relating them to the rest of a config being the
    whole config's.  Every attribute reads the parsed block.  ``offload_param`` / ``offload_optimizer`` are
    None when the block was not given and offloads nothing, as DeepSpeed leaves them without the block, else
    a view of it (``device``, ``nvme_path``, ``pin_memory``, ``buffer_count``, ...)."""

    __slots__ = ("_given",)
    _block: ZeroConfig

    def __init__(self, **fields: Any) -> None:
        raw = {_RENAMED.get(name, name): value for name, value in fields.items()}
        super().__init__(load_zero_block(raw))
        given = {name for name in ("offload_param", "offload_optimizer") if raw.get(name) is not None}
        object.__setattr__(self, "_given", frozenset(given))

    @classmethod
    def of(cls, block: Any) -> Any:
        view = super().of(block)
        object.__setattr__(view, "_given", frozenset())
        return view

    @property
    def stage(self) -> ZeroStageEnum:
        return ZeroStageEnum(self._block.stage)

    @property
    def offload_param(self) -> Optional[DeepSpeedZeroOffloadParamConfig]:
        return self._offload("offload_param", self._block.offload_param, DeepSpeedZeroOffloadParamConfig)

    @property
    def offload_optimizer(self) -> Optional[DeepSpeedZeroOffloadOptimizerConfig]:
        return self._offload("offload_optimizer", self._block.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)

    def _offload(self, name: str, block: Any, view: type[_OffloadView]) -> Any:
        if block.device == "none" and name not in self._given:
            return None
        return view.of(block)

    @property
    def leaf_module(self) -> DeepSpeedZeroLeafModuleConfig:
        return DeepSpeedZeroLeafModuleConfig.of(self._block.leaf_module)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _DEFAULTS:
            return _DEFAULTS[name]
        return getattr(self._block, _RENAMED.get(name, name))
