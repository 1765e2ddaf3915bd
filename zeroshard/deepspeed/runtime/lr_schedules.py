"""``zeroshard.deepspeed.runtime.lr_schedules``: DeepSpeed's schedule classes and ``VALID_LR_SCHEDULES``."""

from ...optim.schedulers import VALID_LR_SCHEDULES, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["VALID_LR_SCHEDULES", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
