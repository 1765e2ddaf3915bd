"""``zeroshard.runtime.utils``: ``set_random_seed``."""

from ..compat.utils import set_random_seed

__all__ = ["set_random_seed"]
