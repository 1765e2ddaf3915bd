"""``zeroshard.deepspeed.runtime.engine.DeepSpeedEngine``: zeroshard's :class:`~zeroshard.engine.engine.Engine`;
``_checkpoint_parallel_metadata``: the layout entry of a DeepSpeed model file
(checkpoint/deepspeed_format/layout_metadata.py)."""

from ...checkpoint.deepspeed_format.layout_metadata import checkpoint_parallel_metadata as _checkpoint_parallel_metadata
from ...engine.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine", "_checkpoint_parallel_metadata"]
