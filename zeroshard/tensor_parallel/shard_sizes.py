"""How many rows of a dimension each tensor-parallel rank holds in DeepSpeed's AutoTP, whose split need
not be even (zeroshard's own split refuses sizes that do not divide; plan.py).

[Note: AutoTP's uneven shard sizes]
AutoTP keeps attention heads whole: where the model's key/value head count divides a dimension (and
the layer is not an MLP or the output head), each rank takes ``kv_heads // size`` heads, the first
``kv_heads % size`` ranks one more, and the dimension follows in whole heads.  Elsewhere it splits in
grains of ``tp_grain_size`` elements the same way (extra grains to the first ranks), the last rank
taking the rows a grain does not cover; a dimension smaller than one grain is split by rows.  These
sizes are what AutoTP's checkpoints record as ``partition_sizes``, and what a universal checkpoint is
cut back into (checkpoint/deepspeed_format/tp_restore.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["AutoTPMeta", "shard_size", "shard_size_list"]

_KV_HEAD_NAMES = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads",
                  "num_attention_heads", "n_heads", "attention_heads")
_HEAD_NAMES = ("num_attention_heads", "num_heads", "n_heads", "n_head", "attention_heads")
_WHOLE_LAYERS = ("lm_head", "embed_out")
_MLP_LAYERS = ("mlp", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _first(config: Any, names: tuple[str, ...]) -> Optional[int]:
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)


@dataclass(frozen=True)
class AutoTPMeta:
    """A model's head counts and grain, read once from its config (its ``text_config`` where it has one)."""

    num_kv_heads: Optional[int] = None
    num_attention_heads: Optional[int] = None
    n_embd: Optional[int] = None
    tp_grain_size: int = 1

    @classmethod
    def from_model_config(cls, model_config: Any, tp_grain_size: int = 1) -> "AutoTPMeta":
        if model_config is None:
            return cls(tp_grain_size=tp_grain_size)
        config = getattr(model_config, "text_config", None) or model_config
        return cls(num_kv_heads=_first(config, _KV_HEAD_NAMES), num_attention_heads=_first(config, _HEAD_NAMES),
                   n_embd=_first(config, ("n_embd", "hidden_size")), tp_grain_size=tp_grain_size)


def _spread(units: int, size: int, rank: int) -> int:
    return units // size + (1 if rank < units % size else 0)


def shard_size(total: int, size: int, meta: Optional[AutoTPMeta], name: Optional[str], rank: int) -> int:
    """Rank ``rank``'s (within the tensor group of ``size``) rows of a dimension of ``total`` (see [Note:
    AutoTP's uneven shard sizes])."""
    meta = meta or AutoTPMeta()
    label = str(name)
    heads = meta.num_kv_heads
    if heads and total % heads == 0 and label not in _WHOLE_LAYERS and not any(m in label for m in _MLP_LAYERS):
        return total * _spread(heads, size, rank) // heads
    grain = max(meta.tp_grain_size, 1)
    if total < grain:
        return _spread(total, size, rank)
    grains, tail = divmod(total, grain)
    return _spread(grains, size, rank) * grain + (tail if rank == size - 1 else 0)


def shard_size_list(total: int, size: int, meta: Optional[AutoTPMeta] = None,
                    name: Optional[str] = None) -> list[int]:
    """Every rank's rows; they always add up to ``total``."""
    sizes = [shard_size(total, size, meta, name, rank) for rank in range(size)]
    assert sum(sizes) == total, f"shard sizes {sizes} of {name} do not add up to {total}"
    return sizes
