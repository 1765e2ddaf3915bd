"""``zeroshard.deepspeed.zero`` (DeepSpeed's ``deepspeed.zero``): Init, GatheredParameters, ZeroParamStatus."""

from ..runtime.zero.partition_parameters import (GatheredParameters, Init, ZeroParamStatus, register_external_parameter,
                           unregister_external_parameter)

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]
