"""``zeroshard.deepspeed.moe.layer.MoE``: refused with the reason (zeroshard has no expert parallelism)."""

from ..refused import MoE

__all__ = ["MoE"]
