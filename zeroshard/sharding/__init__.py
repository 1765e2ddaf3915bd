"""Flat buffers, bucket plans and one strategy per ZeRO stage."""

from .layout import BucketLayout, FlatLayout, plan_buckets
from .flat_params import FlatParameters
from .strategy import ShardingStrategy
from .stage0 import Stage0
from .stage1 import Stage1
from .stage2 import Stage2
from .stage3.strategy import Stage3

STRATEGIES: dict[int, type[ShardingStrategy]] = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}

__all__ = ["BucketLayout", "FlatLayout", "plan_buckets", "FlatParameters", "ShardingStrategy",
           "Stage0", "Stage1", "Stage2", "Stage3", "STRATEGIES"]
