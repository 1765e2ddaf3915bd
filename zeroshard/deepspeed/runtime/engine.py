"""``zeroshard.deepspeed.runtime.engine.DeepSpeedEngine``: zeroshard's :class:`~zeroshard.engine.engine.Engine`."""

from ...engine.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
