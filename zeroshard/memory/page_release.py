"""Give a buffer's physical pages back to the system while the buffer stays allocated.

[Note: releasing a gathered unit's pages]
Stage 3 gathers a unit's full buffer before its module runs and releases it after.  Freeing the
buffer (shrinking its storage) hands the memory to glibc, which serves the next gather from its heap
and keeps what is freed there (see [Note: glibc keeps what training frees] in host_allocator.py):
the units' buffers, re-allocated every step, then mix with activations and gradients of changing
sizes in a heap that only grows.  Instead, in host memory on Linux, each unit's buffer stays
allocated for the whole run and releasing it drops its pages with ``madvise(MADV_DONTNEED)``: the
kernel takes them back at once, the next gather's writes fault fresh zeroed pages in, and no other
allocation can move into the hole.  The buffers ask for transparent huge pages
(``MADV_HUGEPAGE``), so that faulting a 27 MiB unit back in costs 14 faults instead of 6912
(measured on this project's 2-core machine, refilling dropped buffers: 1.2 GiB/s with 4 KiB pages,
3.2 GiB/s with huge pages, 4.5 GiB/s for buffers whose pages are kept: about 0.04 s a step for the
364 MB a 91M-parameter model gathers once a step at DeepSpeed's default reuse distance).  At 91M parameters on two ranks (benchmarks/RESULTS.md)
the peak RSS under glibc's defaults stays within the noise, but what is released is really gone:
with ``host_memory_trim`` stage 3 peaks at ~1780 MiB, against ~1950 when the units went through
the heap.

A released buffer reads as zeros rather than as freed memory; nothing reads it (the modules show
placeholders, see placeholder.py, and every use gathers first).  Where ``madvise`` is not available
(not Linux, or device memory) the caller frees the storage instead, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from typing import Any, Optional

import torch

_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_PAGE = mmap.PAGESIZE
_HUGE_PAGE = 2 << 20


def _libc() -> Optional[Any]:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "madvise") or not hasattr(libc, "mincore"):
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.mincore.restype = ctypes.c_int
    return libc


_LIBC = _libc()


def can_release_pages(tensor: torch.Tensor) -> bool:
    """True where :func:`release_pages` works on ``tensor``'s memory (host memory on Linux)."""
    return _LIBC is not None and tensor.device.type == "cpu"


def _whole_pages(tensor: torch.Tensor, page: int = _PAGE) -> tuple[int, int]:
    """The page-aligned part of the tensor's storage: (address, length); length 0 if none."""
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    first = -(-start // page) * page
    last = end // page * page
    return first, max(0, last - first)


def _check(tensor: torch.Tensor) -> Any:
    if _LIBC is None or tensor.device.type != "cpu":
        raise RuntimeError("page release needs host memory on Linux: check can_release_pages() first")
    return _LIBC


def prefer_huge_pages(tensor: torch.Tensor) -> None:
    """Ask for transparent huge pages under ``tensor``'s storage (advice: a kernel without THP, or
    with THP off, ignores it and the buffer keeps 4 KiB pages)."""
    address, length = _whole_pages(tensor, _HUGE_PAGE)
    if length:
        _check(tensor).madvise(address, length, _MADV_HUGEPAGE)


def release_pages(tensor: torch.Tensor) -> None:
    """Drop the physical pages under ``tensor``'s storage (its values become zeros); the storage
    keeps its address and size.  Only whole pages go: a partial page at either end stays resident."""
    libc = _check(tensor)
    address, length = _whole_pages(tensor)
    if length and libc.madvise(address, length, _MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) of {length} bytes at {address:#x} failed")


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s storage in physical memory now (``mincore``), whole pages only."""
    libc = _check(tensor)
    address, length = _whole_pages(tensor)
    if not length:
        return 0
    vector = bytearray(length // _PAGE)
    if libc.mincore(address, length, (ctypes.c_ubyte * len(vector)).from_buffer(vector)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore of {length} bytes at {address:#x} failed")
    return int(torch.frombuffer(vector, dtype=torch.uint8).bitwise_and(1).sum()) * _PAGE
