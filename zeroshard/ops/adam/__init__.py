"""``zeroshard.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` (torch's fused Adam/AdamW)."""

from ...compat.ops import DeepSpeedCPUAdam, FusedAdam

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]
