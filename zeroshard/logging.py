"""zeroshard's one logging module: rank-aware messages, warn-once, and a per-step metrics line."""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

logger = logging.getLogger("zeroshard")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[zeroshard %(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(os.environ.get("ZEROSHARD_LOG_LEVEL", "INFO"))
    logger.propagate = False

_warned: set[str] = set()


def current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_rank(message: str, rank: int | None = 0, level: int = logging.INFO) -> None:
    """Log ``message`` on ``rank`` only (``None``: on every rank, prefixed with the rank)."""
    me = current_rank()
    if rank is None:
        logger.log(level, f"rank {me}: {message}")
    elif rank == me:
        logger.log(level, message)


def warn_once(message: str) -> None:
    """Warn on rank 0, once per distinct message for the life of the process."""
    if message not in _warned:
        _warned.add(message)
        log_rank(message, rank=0, level=logging.WARNING)
