"""``deepspeed.runtime.zero.stage3``: DeepSpeed's ZeRO-3 optimizer wrapper class, refused by name.

DeepSpeed's engine wraps the user's optimizer in ``DeepSpeedZeroOptimizer_Stage3`` at stage 3;
zeroshard's stage 3 is its sharding strategy (sharding/stage3/strategy.py) and ``engine.optimizer`` is
the torch optimizer over this rank's shard, so no engine's optimizer is an instance of this class.
Code that imports it (isinstance checks) loads; building one raises, saying what to use.
"""

from __future__ import annotations

from ...refused import refused_wrapper


DeepSpeedZeroOptimizer_Stage3 = refused_wrapper(
    "DeepSpeedZeroOptimizer_Stage3",
    "DeepSpeedZeroOptimizer_Stage3 is DeepSpeed's stage 3 optimizer wrapper; zeroshard shards the "
    "optimizer inside its engine: pass the optimizer to zeroshard.initialize() with "
    "zero_optimization.stage 3")
