"""``zeroshard.moe.layer.MoE``: refused with the reason (zeroshard has no expert parallelism)."""

from ..compat.refused import MoE

__all__ = ["MoE"]
