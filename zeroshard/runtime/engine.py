"""``zeroshard.runtime.engine.DeepSpeedEngine``: zeroshard's :class:`~zeroshard.engine.Engine`."""

from ..engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
