"""An explicit host-allocator setting: give freed memory back to the system (``host_memory_release``).

[Note: glibc keeps what training frees]
glibc's ``malloc`` serves a large block with its own ``mmap`` (returned on ``free``) only above a
threshold that it raises, by default, to the size of every such block freed, up to 32 MiB
(``mallopt(3)``: the dynamic mmap threshold).  After the first step, a training job's gradient
buckets, gathered units and collective temporaries therefore come from the heap, and when they are
freed the heap keeps them: measured at 91M parameters on two ranks, glibc held 450-900 MiB freed but
not returned at the peak of every stage, so the memory ZeRO saves did not show in the process's RSS.
With the threshold fixed at 1 MiB, blocks of a MiB or more are mapped and unmapped one by one and
RSS follows live memory, at the price of page faults on every new large block (the step-time cost is
measured in benchmarks/RESULTS.md).  It is a process-wide setting, so it is an explicit config key,
off by default; ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment do the same
for any program.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable, Optional

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: blocks at least this large are mapped on their own and returned to the system when freed
RELEASE_THRESHOLD = 1 << 20


def _mallopt() -> Optional[Callable[[int, int], int]]:
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    except OSError:
        return None


def release_freed_memory(threshold: int = RELEASE_THRESHOLD) -> bool:
    """Fix glibc's mmap and trim thresholds at ``threshold`` bytes (see the Note); False where the C
    library has no ``mallopt`` (not glibc), and nothing changes."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, threshold))
