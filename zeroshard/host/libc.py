"""The C library's memory calls, loaded once for the memory modules: ``madvise`` and ``mincore``
(page_release.py, file_pages.py), ``mremap`` (page_reserve.py), ``mallopt`` and ``malloc_trim``
(host_allocator.py).

Each is None where the C library lacks it (``malloc_trim`` and ``mallopt`` are glibc's; ``madvise``,
``mincore`` and ``mremap`` are loaded on Linux only), and every caller has a path for that.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from typing import Any, Optional

MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 << 20


def _load() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None


def _function(name: str, argtypes: list[Any], linux_only: bool = False) -> Optional[Any]:
    if _LIBC is None or (linux_only and not sys.platform.startswith("linux")):
        return None
    func = getattr(_LIBC, name, None)
    if func is not None:
        func.argtypes = argtypes
        func.restype = ctypes.c_int
    return func


_LIBC = _load()
madvise = _function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], linux_only=True)
mincore = _function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p], linux_only=True)
mallopt = _function("mallopt", [ctypes.c_int, ctypes.c_int])
malloc_trim = _function("malloc_trim", [ctypes.c_size_t])
#: moves pages between mappings (page_reserve.py); returns the new address, or MAP_FAILED
mremap = _function("mremap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p],
                   linux_only=True)
if mremap is not None:
    mremap.restype = ctypes.c_void_p


def whole_pages(start: int, nbytes: int, page: int = PAGE) -> tuple[int, int]:
    """The page-aligned part of ``[start, start + nbytes)``: (address, length); length 0 if none."""
    first = -(-start // page) * page
    last = (start + nbytes) // page * page
    return first, max(0, last - first)


def errno_message(call: str, length: int, address: int) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{call} of {length} bytes at {address:#x} failed")
