"""``deepspeed.runtime.zero.tiling``: a linear layer cut into tiles that stage 3 gathers one at a time
(:mod:`zeroshard.sharding.stage3.tiled_linear`), under DeepSpeed's names."""

from __future__ import annotations

from ....sharding.stage3.tiled_linear import TileCountError, TiledLinear, TiledLinearReturnBias

__all__ = ["TiledLinear", "TiledLinearReturnBias", "TileCountError"]
