"""The recipes by name, as torchao's float8 training configs; torchao imported only when FP8 is on.

[Note: torchao for the FP8 layers]
The FP8 layers are torchao's ``Float8Linear`` (PyTorch's own library for float8 training, the layer
torchtitan trains with), not a layer of zeroshard's own over ``torch._scaled_mm``: its recipes are the
ones people use, with the numerics they are measured with, and on torch's CPU build the same
``torch._scaled_mm`` runs as on a GPU, so what the tests check here is what a GPU runs.  It composes with
every ZeRO stage because a ``Float8Linear`` is an ``nn.Linear`` that keeps the converted layer's own
``weight`` and ``bias`` parameters: stages 0-2 hold them as views of their flat buffer, stage 3 moves
their storage in and out at each gather and release, and the layer reads ``self.weight`` at every
forward, whatever storage it has then.  torchao is an optional dependency (the ``fp8`` extra), imported
the first time a recipe is asked for, so that ``import zeroshard`` never needs it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from typing import Any, Iterator

from ..config.fp8_block import FP8_RECIPES
from .errors import FP8ConfigError, FP8UnavailableError

__all__ = ["FP8_RECIPES", "float8_config", "torchao_float8"]

#: loggers that talk while torchao is imported: its optional kernels' libraries (built for GPUs) that a CPU
#: build cannot load, and torch's notice about an enum torchao registers
_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


def torchao_float8() -> Any:
    """``torchao.float8``, imported once, without the lines its import logs about optional GPU kernels."""
    with _quiet(_IMPORT_LOGGERS):
        try:
            return importlib.import_module("torchao.float8")
        except ImportError as exc:
            raise FP8UnavailableError(
                "FP8 training needs torchao (pip install 'zeroshard[fp8]', or torchao==0.18.0); it is not "
                f"importable here: {exc}") from exc


def float8_config(recipe: str) -> Any:
    """torchao's ``Float8LinearConfig`` of ``recipe`` (one of :data:`FP8_RECIPES`)."""
    if recipe not in FP8_RECIPES:
        raise FP8ConfigError(f"'fp8.recipe' = {recipe!r} is not a known FP8 recipe; use one of "
                             f"{', '.join(FP8_RECIPES)}")
    return torchao_float8().Float8LinearConfig.from_recipe_name(recipe)


@contextlib.contextmanager
def _quiet(names: tuple[str, ...]) -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
