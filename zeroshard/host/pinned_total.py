"""How much host memory this process has page-locked, and a log line each time the total doubles.

Pinned (page-locked) memory cannot be swapped out and counts against the memlock limit (``ulimit
-l``); a host that runs out of memory usually does so far from the call that pinned the most, so a
running total, logged at a few milestones, says where the resident budget went.  Milestones start at
32 GiB and double (64, 128, ...), so even offloading every shard of a large model logs a handful of
lines, never one per allocation.  The accelerator's ``pin_memory`` (what DeepSpeed-style code calls)
and stage 3's host shards pin through :func:`pin_host_tensor`, which counts; DeepSpeed's
``deepspeed.utils.pin_memory_tracker`` is this module under its names.
"""

from __future__ import annotations

import torch

from ..logging import logger

_GIB = 1024 ** 3
#: the first milestone; each next one is twice the previous
FIRST_MILESTONE_BYTES = 32 * _GIB


def format_bytes(num_bytes: int) -> str:
    """``512 B``, ``2.0 KB``, ``1.00 MB``, ``1.000 GB``: more digits as the unit grows, so a
    milestone's gigabytes read to the megabyte."""
    for unit, scale, digits in (("GB", _GIB, 3), ("MB", 1024 ** 2, 2), ("KB", 1024, 1)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.{digits}f} {unit}"
    return f"{num_bytes} B"


class PinnedMemoryTotal:
    """The process's running total of pinned bytes and pin calls, with its next milestone."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything counted (tests, or a fresh phase of a job)."""
        self._bytes = 0
        self._calls = 0
        self._next_checkpoint = FIRST_MILESTONE_BYTES

    @property
    def pinned_bytes(self) -> int:
        return self._bytes

    @property
    def pin_calls(self) -> int:
        return self._calls

    def track(self, num_bytes: int) -> None:
        """Count one pin of ``num_bytes``; log every milestone it crosses (several, for a big one)."""
        if num_bytes < 0:
            raise ValueError(f"a pin of {num_bytes} bytes: the size of pinned memory cannot be negative")
        self._bytes += num_bytes
        self._calls += 1
        logger.debug(f"pinned {format_bytes(num_bytes)} (pin #{self._calls}, {format_bytes(self._bytes)} in all)")
        while self._bytes >= self._next_checkpoint:
            logger.info(f"[pinned-memory checkpoint] crossed {format_bytes(self._next_checkpoint)}: "
                        f"{format_bytes(self._bytes)} pinned across {self._calls} allocations")
            self._next_checkpoint *= 2

    def log_summary(self, tag: str = "") -> None:
        """One info line with the total, labelled ``tag`` (where in the job it was taken)."""
        label = f"[pinned-memory {tag}]" if tag else "[pinned-memory]"
        logger.info(f"{label} {format_bytes(self._bytes)} pinned across {self._calls} allocations")


#: the process's one total (pinned memory is a per-process limit)
PINNED = PinnedMemoryTotal()


def pin_host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in page-locked memory (a copy, as ``Tensor.pin_memory`` makes), counted in
    :data:`PINNED`; already pinned, it is returned as it is and not counted again."""
    if tensor.is_pinned():
        return tensor
    pinned = tensor.pin_memory()
    PINNED.track(pinned.nbytes)
    return pinned
