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
364 MB a 91M-parameter model gathers once a step at DeepSpeed's default reuse distance).  At 91M
parameters on two ranks (benchmarks/RESULTS.md) the peak RSS under glibc's defaults stays within
the noise, but what is released is really gone:
with ``host_memory_trim`` stage 3 peaks at ~1780 MiB, against ~1950 when the units went through
the heap.

What faulting back in costs depends on the host.  On a virtual machine whose guest reports free
memory to the hypervisor (virtio-balloon free page reporting, as on this project's machine), pages
that stay free for about two seconds go to the host, and touching them again costs a fault there as
well: 351 MiB refilled in 0.06-0.07 s up to a second after the drop, 0.17 s from two seconds on
(benchmarks/bench_page_refill.py).  A unit released in one backward is gathered again in the next
forward, seconds later, so stage 3 pays that price every step (benchmarks/RESULTS.md, seventeenth
session: much of stage 3's step time above DDP's there).

Since the nineteenth session a release hands its pages to a reserve that moves them under the next
buffer filled, dropping only what the reserve cannot hold ([Note: released pages move to the next
gather] in page_reserve.py).

A released buffer reads as zeros (or stale values, under the reserve) rather than as freed memory;
nothing reads it (the modules show placeholders, see placeholder.py, and every use gathers first).
Where ``madvise`` is not available (not Linux, or device memory) the caller frees the storage
instead, as before.
"""

from __future__ import annotations

import ctypes

import torch

from . import libc


def can_release_pages(tensor: torch.Tensor) -> bool:
    """True where :func:`release_pages` works on ``tensor``'s memory (host memory on Linux)."""
    return libc.madvise is not None and libc.mincore is not None and tensor.device.type == "cpu"


def whole_pages_of(tensor: torch.Tensor, page: int = libc.PAGE) -> tuple[int, int]:
    """The page-aligned part of the tensor's own bytes (a contiguous view: only the pages lying wholly
    inside it, so that its neighbours in the same storage are untouched): (address, length); length 0
    if none."""
    if not can_release_pages(tensor):
        raise RuntimeError("page release needs host memory on Linux: check can_release_pages() first")
    if not tensor.is_contiguous():
        raise RuntimeError("page release needs a contiguous tensor: its bytes must be one range")
    return libc.whole_pages(tensor.data_ptr(), tensor.numel() * tensor.element_size(), page)


def prefer_huge_pages(tensor: torch.Tensor) -> None:
    """Ask for transparent huge pages under ``tensor`` (advice: a kernel without THP, or
    with THP off, ignores it and the buffer keeps 4 KiB pages)."""
    address, length = whole_pages_of(tensor, libc.HUGE_PAGE)
    if length and libc.madvise is not None:
        libc.madvise(address, length, libc.MADV_HUGEPAGE)


def release_pages(tensor: torch.Tensor) -> None:
    """Drop the physical pages under ``tensor`` (its values become zeros); the storage keeps its
    address and size.  Only whole pages go: a partial page at either end stays resident, so a view
    gives back its own pages and leaves its neighbours' values alone."""
    drop_pages(*whole_pages_of(tensor))


def drop_pages(address: int, length: int) -> None:
    """Drop the physical pages of [address, address + length) (page-aligned; length 0: nothing)."""
    if length and libc.madvise is not None and libc.madvise(address, length, libc.MADV_DONTNEED) != 0:
        raise libc.errno_message("madvise(MADV_DONTNEED)", length, address)


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor`` in physical memory now (``mincore``), whole pages only."""
    address, length = whole_pages_of(tensor)
    if not length or libc.mincore is None:
        return 0
    vector = bytearray(length // libc.PAGE)
    if libc.mincore(address, length, (ctypes.c_ubyte * len(vector)).from_buffer(vector)) != 0:
        raise libc.errno_message("mincore", length, address)
    return int(torch.frombuffer(vector, dtype=torch.uint8).bitwise_and(1).sum()) * libc.PAGE


def held_bytes(tensor: torch.Tensor) -> int:
    """Memory under ``tensor`` now: its resident whole pages where pages can be released (the partial
    page at either end is not counted), else its storage's bytes."""
    return resident_bytes(tensor) if can_release_pages(tensor) else tensor.untyped_storage().nbytes()
