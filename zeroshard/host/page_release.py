"""Give a buffer's physical pages back to the system while the buffer stays allocated.

[Note: releasing a gathered unit's pages]
Stage 3 gathers a unit's full buffer before its module runs and releases it after.  Freeing the
buffer (shrinking its storage) would hand the memory to glibc, which serves the next gather from its
heap and keeps what is freed there (see [Note: glibc keeps what training frees] in
host/host_allocator.py): the units' buffers, allocated again every step, would mix with activations
and gradients of changing sizes in a heap that only grows.  So, in host memory on Linux, each unit's
buffer stays allocated for the whole run and a release gives back its pages, not its addresses: they
go first to a reserve that moves them under the next buffer filled ([Note: released pages move to the
next gather] in host/page_reserve.py), and what the reserve cannot hold is dropped here with
``madvise(MADV_DONTNEED)``: the kernel takes it back at once, the next writes fault fresh zeroed pages
in, and no other allocation can move into the hole.  What is released is therefore really gone from
the process: with ``host_memory_trim`` stage 3 peaks lower than with its units' buffers on the heap.
The buffers ask for transparent huge pages (``MADV_HUGEPAGE``), so that faulting a 27 MiB unit back in
costs 14 faults instead of 6912, which refills a dropped buffer much faster.

What faulting back in costs depends on the host.  On a virtual machine whose guest reports free
memory to the hypervisor (virtio-balloon free page reporting), pages that stay free for about two
seconds go to the host, and touching them again costs a fault there as well: a refill takes far longer
two seconds after the drop than right after it.  A unit released in one backward is
gathered again in the next forward, seconds later, when the pages it dropped are cold: the reason the
reserve moves pages instead of dropping them.  The figures (huge pages, refill rates, stage 3's peak)
are in benchmarks/RESULTS.md, section "What faulting released pages back in costs"
(benchmarks/bench_page_refill.py).

A released buffer reads as zeros (or stale values, under the reserve) rather than as freed memory;
nothing reads it (the modules show placeholders, see sharding/stage3/placeholder.py, and every use
gathers first).  Where ``madvise`` is not available (not Linux, or device memory) the caller frees the
storage instead.
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
