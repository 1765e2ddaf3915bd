"""``zeroshard.deepspeed.runtime`` (DeepSpeed's ``deepspeed.runtime``): the module paths DeepSpeed code imports from."""

from . import (bf16_optimizer, config, config_utils, engine, lr_schedules, pipe, precision_config, sequence_parallel,
               utils, zero)

__all__ = ["bf16_optimizer", "config", "config_utils", "engine", "lr_schedules", "pipe", "precision_config",
           "sequence_parallel", "utils", "zero"]
