"""``deepspeed.runtime.fp16.fused_optimizer``: DeepSpeed's fused fp16 wrapper class, refused by name.

As ``FP16_UnfusedOptimizer`` (unfused_optimizer.py): zeroshard's fp32 masters live in its engine's
updater and ``engine.optimizer`` is the torch optimizer over the shards, so no engine's optimizer is
an instance of this class; code that imports it (isinstance checks) loads, and building one raises.
"""

from __future__ import annotations

from ...refused import refused_wrapper


FP16_Optimizer = refused_wrapper(
    "FP16_Optimizer",
    "FP16_Optimizer is DeepSpeed's fused fp16 optimizer wrapper; zeroshard keeps the fp32 masters in its "
    "engine's updater and engine.optimizer is the plain torch optimizer over the shards: build the "
    "optimizer you want and pass it to zeroshard.initialize() with 'fp16': {'enabled': true}")
