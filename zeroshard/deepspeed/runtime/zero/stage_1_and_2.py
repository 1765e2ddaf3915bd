"""``deepspeed.runtime.zero.stage_1_and_2``: DeepSpeed's ZeRO 1-2 optimizer wrapper class, refused by name.

DeepSpeed's engine wraps the user's optimizer in ``DeepSpeedZeroOptimizer`` at stages 1-2; zeroshard's
stages are its sharding strategies (sharding/stage1.py, stage2.py) and ``engine.optimizer`` is the
torch optimizer over this rank's shard, so no engine's optimizer is an instance of this class.  Code
that imports it (isinstance checks) loads; building one raises, saying what to use.  Its universal-
checkpoint methods, which need no construction, work on ``bit16_groups`` (checkpoint/deepspeed_format/
tp_restore.py).
"""

from __future__ import annotations

from ....checkpoint.deepspeed_format.tp_restore import UniversalInfoCache
from ...refused import refused_wrapper


class _Bit16Groups(UniversalInfoCache):
    GROUPS = "bit16_groups"


DeepSpeedZeroOptimizer = refused_wrapper(
    "DeepSpeedZeroOptimizer",
    "DeepSpeedZeroOptimizer is DeepSpeed's stage 1-2 optimizer wrapper; zeroshard shards the optimizer "
    "inside its engine: pass the optimizer to zeroshard.initialize() with zero_optimization.stage 1 or 2",
    (_Bit16Groups, ))
