"""``deepspeed.utils.logging``: DeepSpeed's logging module, over zeroshard's one logger.

Libraries reach DeepSpeed's logger through this path (Lightning's ``DeepSpeedStrategy`` sets its level
with ``deepspeed.utils.logging.logger.setLevel``); ``logger`` is :mod:`zeroshard.logging`'s, so a level
set here is the level of every zeroshard message.
"""

from __future__ import annotations

import logging as _logging
from typing import Iterable, Optional

from ...logging import current_rank, logger

__all__ = ["logger", "log_dist", "get_current_level", "should_log_le"]


def log_dist(message: str, ranks: Optional[Iterable[int]] = None, level: int = _logging.INFO) -> None:
    """Log ``message`` on the listed ranks (``None`` or ``[-1]``: every rank), prefixed with the rank."""
    chosen = None if ranks is None else set(ranks)
    me = current_rank()
    if chosen is None or -1 in chosen or me in chosen:
        logger.log(level, f"[Rank {me}] {message}")


def get_current_level() -> int:
    """The logger's effective level."""
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the logger's level is at or below the named level (``"info"``, ``"warning"``, ...)."""
    level = _logging.getLevelName(max_log_level_str.upper())
    if not isinstance(level, int):
        raise ValueError(f"{max_log_level_str!r} is not a logging level")
    return get_current_level() <= level
