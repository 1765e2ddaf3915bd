"""``zeroshard.runtime.zero.partition_parameters``: where DeepSpeed code imports stage-3 names from."""

from ...compat.zero import (GatheredParameters, Init, ZeroParamStatus, register_external_parameter,
                            unregister_external_parameter)

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]
