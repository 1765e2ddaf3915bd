"""Explicit host-allocator settings: give freed memory back to the system (``host_memory_release``,
``host_memory_trim``).

[Note: glibc keeps what training frees]
glibc's ``malloc`` serves a large block with its own ``mmap`` (returned on ``free``) only above a
threshold that it raises, by default, to the size of every such block freed, up to 32 MiB
(``mallopt(3)``: the dynamic mmap threshold).  After the first step, a training job's activations,
gradient buckets and collective temporaries therefore come from the heap, and when they are freed
the heap keeps them: at every stage, hundreds of MiB freed but not returned sit in the peak, so the
memory ZeRO saves need not show in the process's RSS (``malloc_stats`` shows it: far more taken from
the system than in use).  Two explicit settings give it back, both off by default, both measured in
benchmarks/RESULTS.md, section "Peak RSS like for like", subsection "Opt-in memory settings":

- ``host_memory_release`` fixes the mmap and trim thresholds at 1 MiB at initialize: blocks of a MiB
  or more are mapped and unmapped one by one, and RSS follows live memory, at the price of page
  faults on every new large block (every activation, every step).  It is process-wide, like
  ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment.
- ``host_memory_trim`` leaves glibc's settings alone and calls ``malloc_trim(0)`` after every
  optimizer step, when the step's activations and gradients are gone: the pages of the heap's free
  blocks go back at once; the next step faults in again what it uses (once a step, not once per
  block), so it costs less than the thresholds and saves less (blocks freed within a step are
  reused, not returned).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..logging import log_rank
from . import libc

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: blocks at least this large are mapped on their own and returned to the system when freed
RELEASE_THRESHOLD = 1 << 20


def release_freed_memory(threshold: int = RELEASE_THRESHOLD) -> bool:
    """Fix glibc's mmap and trim thresholds at ``threshold`` bytes (see the Note); False where the C
    library has no ``mallopt`` (not glibc), and nothing changes."""
    if libc.mallopt is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, threshold))


def trim_free_memory() -> bool:
    """Give the pages of the heap's free blocks back to the system (``malloc_trim(0)``, every arena);
    False where the C library has no ``malloc_trim`` (not glibc)."""
    if libc.malloc_trim is None:
        return False
    libc.malloc_trim(0)
    return True


@dataclass(frozen=True)
class HostMemoryPolicy:
    """What the engine does with host memory the allocator keeps (see the Note)."""

    #: ``host_memory_release``: glibc's thresholds fixed at 1 MiB from initialize on
    release_large_blocks: bool = False
    #: ``host_memory_trim``: ``malloc_trim(0)`` after every optimizer step
    trim_after_step: bool = False

    def apply(self) -> "HostMemoryPolicy":
        """At initialize: set what can be set; a setting the C library lacks is dropped with a
        warning (the policy returned is what is in force)."""
        release, trim = self.release_large_blocks, self.trim_after_step
        if release and not release_freed_memory():
            log_rank("host_memory_release: the C library has no mallopt (not glibc); the allocator is unchanged",
                     level=logging.WARNING)
            release = False
        if trim and libc.malloc_trim is None:
            log_rank("host_memory_trim: the C library has no malloc_trim (not glibc); nothing is trimmed",
                     level=logging.WARNING)
            trim = False
        return HostMemoryPolicy(release, trim)

    def after_step(self) -> None:
        if self.trim_after_step:
            trim_free_memory()
