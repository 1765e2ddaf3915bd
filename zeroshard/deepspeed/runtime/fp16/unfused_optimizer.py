"""``deepspeed.runtime.fp16.unfused_optimizer``: DeepSpeed's wrapper class, refused by name.

DeepSpeed wraps the user's optimizer in ``FP16_UnfusedOptimizer`` for fp16 without ZeRO; zeroshard keeps
fp32 masters in its own updater (``optim/updater.py``: ``MasterUpdater``) and ``engine.optimizer`` is
the torch optimizer over the shards, so there is no such wrapper to build.  The name exists so that
code importing it loads; building one raises :class:`NotSupportedByZeroshard` saying where the masters
are, and an ``isinstance`` check against it is false.
"""

from __future__ import annotations

from ...refused import refused_wrapper


FP16_UnfusedOptimizer = refused_wrapper(
    "FP16_UnfusedOptimizer",
    "FP16_UnfusedOptimizer is DeepSpeed's fp16 optimizer wrapper; zeroshard keeps the fp32 masters in "
    "its engine's updater and engine.optimizer is the plain torch optimizer over the shards: build the "
    "optimizer you want and pass it to zeroshard.initialize() with 'fp16': {'enabled': true}")
