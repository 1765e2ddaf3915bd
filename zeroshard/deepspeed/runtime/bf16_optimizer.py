"""``deepspeed.runtime.bf16_optimizer``: DeepSpeed's bf16 optimizer wrapper class, refused by name.

DeepSpeed wraps the optimizer in ``BF16_Optimizer`` in some of its bf16 configurations; zeroshard keeps
bf16 training's fp32 masters in its engine's updater at every stage, so no engine's optimizer is an
instance of this class.  Code that imports it loads; building one raises.  Its universal-checkpoint methods, which need no construction,
work on ``bf16_groups`` (checkpoint/deepspeed_format/tp_restore.py).
"""

from __future__ import annotations

from ...checkpoint.deepspeed_format.tp_restore import UniversalInfoCache
from ..refused import refused_wrapper


class _Bf16Groups(UniversalInfoCache):
    GROUPS = "bf16_groups"


BF16_Optimizer = refused_wrapper(
    "BF16_Optimizer",
    "BF16_Optimizer is DeepSpeed's bf16 optimizer wrapper; zeroshard keeps the fp32 masters in its engine's "
    "updater: pass the optimizer to zeroshard.initialize() with 'bf16': {'enabled': true}",
    (_Bf16Groups, ))
