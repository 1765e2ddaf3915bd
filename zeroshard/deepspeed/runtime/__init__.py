"""``zeroshard.deepspeed.runtime`` (DeepSpeed's ``deepspeed.runtime``): the module paths DeepSpeed code imports from."""

from . import config, config_utils, engine, lr_schedules, precision_config, sequence_parallel, utils, zero

__all__ = ["config", "config_utils", "engine", "lr_schedules", "precision_config", "sequence_parallel", "utils",
           "zero"]
