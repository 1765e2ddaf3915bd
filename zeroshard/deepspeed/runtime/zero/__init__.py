"""``zeroshard.deepspeed.runtime.zero`` (DeepSpeed's ``deepspeed.runtime.zero``)."""

from . import config, linear, partition_parameters
from .partition_parameters import GatheredParameters, Init, ZeroParamStatus, register_external_parameter

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter", "partition_parameters",
           "config", "linear"]
