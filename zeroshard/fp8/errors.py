"""The FP8 layer's named errors: a bad selection of layers, and torchao missing."""

from __future__ import annotations

from ..config.errors import ConfigError

__all__ = ["FP8ConfigError", "FP8UnavailableError"]


class FP8ConfigError(ConfigError):
    """An FP8 request that cannot be served as written: an unknown recipe, a pattern matching no linear layer,
    no layer left to convert.  A :class:`~zeroshard.config.ConfigError`, raised alike on every rank before the
    first step (the same model and config give the same answer everywhere)."""


class FP8UnavailableError(ImportError):
    """FP8 was asked for, and torchao (the ``fp8`` extra: ``pip install zeroshard[fp8]``) is not installed."""
