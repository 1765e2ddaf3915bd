"""The ``zeroshard`` logger and rank-aware logging.

The logger writes to stderr as ``[zeroshard LEVEL] message`` at the level named by
``ZEROSHARD_LOG_LEVEL`` (default INFO), and does not propagate to the root logger.
:func:`log_rank` logs on one rank (rank 0 by default) or on every rank with a rank prefix.
The engine logs its messages (skipped steps, the per-step metrics line) through :func:`log_rank`;
``deepspeed.utils.logger`` and ``log_dist`` (:mod:`zeroshard.deepspeed.utils`) use the same logger.
"""

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


def current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_rank(message: str, rank: int | None = 0, level: int = logging.INFO) -> None:
    """Log ``message`` on ``rank`` only (``None``: on every rank, prefixed with the rank)."""
    me = current_rank()
    if rank is None:
        logger.log(level, f"rank {me}: {message}")
    elif rank == me:
        logger.log(level, message)
