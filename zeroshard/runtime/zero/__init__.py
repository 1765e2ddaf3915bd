"""``zeroshard.runtime.zero`` (DeepSpeed's ``deepspeed.runtime.zero``)."""

from ...compat.zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter
from . import partition_parameters

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter", "partition_parameters"]
