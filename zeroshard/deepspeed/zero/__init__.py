"""``zeroshard.deepspeed.zero`` (DeepSpeed's ``deepspeed.zero``): Init, GatheredParameters, ZeroParamStatus,
TiledLinear."""

from ..runtime.zero.partition_parameters import (GatheredParameters, Init, ZeroParamStatus, register_external_parameter,
                           unregister_external_parameter)
from ..runtime.zero.tiling import TiledLinear, TiledLinearReturnBias

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter", "TiledLinear", "TiledLinearReturnBias"]
