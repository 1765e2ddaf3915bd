"""``zeroshard.utils`` (DeepSpeed's ``deepspeed.utils``): the logger, ``RepeatingLoader``, ``log_dist``,
``set_random_seed`` and ``zero_to_fp32``."""

from __future__ import annotations

import logging
import random
from typing import Any, Iterable, Iterator, Optional

import torch

from ...logging import current_rank, logger
from . import zero_to_fp32

__all__ = ["logger", "log_dist", "RepeatingLoader", "set_random_seed", "zero_to_fp32"]


def log_dist(message: str, ranks: Optional[Iterable[int]] = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the listed ranks (``None`` or ``[-1]``: every rank), prefixed with the rank."""
    chosen = None if ranks is None else set(ranks)
    me = current_rank()
    if chosen is None or -1 in chosen or me in chosen:
        logger.log(level, f"[Rank {me}] {message}")


class RepeatingLoader:
    """Iterate a data loader forever, starting it over (a new epoch) each time it runs out."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators on this rank."""
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)
