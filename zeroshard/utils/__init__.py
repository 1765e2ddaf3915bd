"""``zeroshard.utils`` (DeepSpeed's ``deepspeed.utils``): logger, RepeatingLoader, zero_to_fp32."""

from ..compat.utils import RepeatingLoader, log_dist, logger, set_random_seed
from . import zero_to_fp32

__all__ = ["logger", "log_dist", "RepeatingLoader", "set_random_seed", "zero_to_fp32"]
