"""``zeroshard.comm`` (DeepSpeed's ``deepspeed.comm``): process-group calls for user code."""

from ..compat.comm import *  # noqa: F401,F403  (the names are listed in compat/comm.py's __all__)
from ..compat.comm import __all__  # noqa: F401
