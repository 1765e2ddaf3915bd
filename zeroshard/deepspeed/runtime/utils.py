"""``zeroshard.deepspeed.runtime.utils``: ``set_random_seed``."""

from ..utils import set_random_seed

__all__ = ["set_random_seed"]
