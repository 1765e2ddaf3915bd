"""``deepspeed.utils.pin_memory_tracker``: the process's total of pinned host memory
(:mod:`zeroshard.host.pinned_total`) under DeepSpeed's names."""

from __future__ import annotations

# DeepSpeed's tests and tools reach the total and the formatter by these private names
from ...host.pinned_total import PINNED as _tracker
from ...host.pinned_total import format_bytes as _fmt_bytes

__all__ = ["track_pinned_memory", "pinned_memory_summary"]


def track_pinned_memory(num_bytes: int) -> None:
    """Count ``num_bytes`` just pinned outside zeroshard's own pins (which count themselves)."""
    _tracker.track(num_bytes)


def pinned_memory_summary(tag: str = "") -> None:
    """Log the total pinned so far, labelled ``tag``."""
    _tracker.log_summary(tag)
