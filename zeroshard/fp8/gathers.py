"""Turn on stage 3's FP8 weight gathers for a model's FP8 layers (the config's ``fp8.gather_weights_in_fp8``;
the gathers themselves: [Note: gathering FP8 weights in FP8] in sharding/stage3/fp8_gathers.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from ..logging import log_rank
from ..sharding.stage3.fp8_gathers import Fp8Gathers
from ..sharding.stage3.sharded_params import ShardedParameters

if TYPE_CHECKING:
    from ..config.fp8_block import FP8Config

__all__ = ["fp8_weights", "gather_fp8_weights"]


def fp8_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights of ``model``'s FP8 layers (taken before the engine shards them)."""
    return [module.weight for module in model.modules()
            if isinstance(module, nn.Linear) and type(module).__name__ == "Float8Linear"]


def gather_fp8_weights(storage: Any, weights: Sequence[torch.Tensor], block: "FP8Config") -> bool:
    """Have ``storage`` gather ``weights`` in FP8 where the config asks and stage 3 gathers them; whether it
    does."""
    if not (block.enabled and block.gather_weights_in_fp8 and block.recipe == "tensorwise"):
        return False
    if not isinstance(storage, ShardedParameters):
        return False
    chosen = {id(w) for w in weights}
    indices = {i for i, p in enumerate(storage.params) if id(p) in chosen}
    buckets = [b for b in storage.layout.buckets if b.index not in storage.persistent]
    gathers = Fp8Gathers(buckets, indices, storage.dtype.itemsize)
    storage.compress_gathers(gathers)
    log_rank(f"fp8: stage 3 gathers {len(gathers.plans)} buckets of FP8 weights in FP8")
    return True
