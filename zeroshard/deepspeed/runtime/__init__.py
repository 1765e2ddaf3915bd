"""``zeroshard.deepspeed.runtime`` (DeepSpeed's ``deepspeed.runtime``): the module paths DeepSpeed code imports from."""

from . import engine, lr_schedules, utils, zero

__all__ = ["engine", "lr_schedules", "utils", "zero"]
