"""Pages that stage 3 releases, handed to the next buffer that needs them instead of to the kernel.

[Note: released pages move to the next gather]
Stage 3 keeps its buffers (gathered units, lent chunks, gradient chunks, gradient buckets) for the
run and releases their memory page by page ([Note: releasing a gathered unit's pages] in
host/page_release.py).  A unit released in one backward is gathered again in the next forward, seconds
later, and on a virtual machine that reports free memory to its hypervisor, pages dropped at the
release and faulted in at the gather are cold by then: a large part of what a stage-3 step would cost
beyond DDP's.

So a :class:`PageReserve` takes what is released and leaves the pages where they are, *parked*: the
buffer no longer owns them, and the next buffer filled takes them, moved under its own addresses with
``mremap(MREMAP_DONTUNMAP)`` (the page tables move; no page is freed, zeroed, faulted or copied, and
both buffers keep their addresses: tensors that autograd saved still point where they did).  Whatever
the reserve cannot cover is faulted in; what is parked beyond ``capacity`` is dropped at once, oldest
first.

Where the pages go.  A forward's gather moves the store's pages under this rank's chunk into the
unit's slot (:meth:`PageReserve.hand_over`; see [Note: a gathered unit borrows this rank's chunk] in
sharding/stage3/sharded_params.py) and fills the rest of the unit from the reserve.  A backward
releases each unit: the slot's pages go home to the store (handed over again), the rest is parked, and
the gradient chunk it produces is filled from the reserve; the step gives the gradient chunks back
(parked); the next forward's gathers take what is parked.  The capacity is what one forward gathers
beyond the chunks its units borrow: exactly what the gathers take from the reserve.  The store's
pages move straight into the slot because they could not usefully be parked: prefetch launches every
gather of a forward before the first unit lends its chunk, so pages parked at lending would wait
through the forward's end, where stage 3 peaks, and dropped instead they would leave half of a
forward's gathers to fault in.  Between steps the parked pages count in the process's RSS
(``memory_breakdown()["parked_pages"]``); at the forward's end the gathers have taken them.  A forward
then faults in next to no pages, and the reserve does not raise the peak RSS (measured in
benchmarks/RESULTS.md, section "What faulting released pages back in costs", paragraph "Stage 3's
pages moved, not faulted").

Every page range the reserve holds lies inside one buffer that released it; a buffer must be filled
(:meth:`PageReserve.fill`) or reclaimed (:meth:`PageReserve.reclaim`) before anything writes to it
again, so that no parked page is moved away from under live values.  Where ``mremap`` cannot move
(not Linux, a kernel older than 5.7) the reserve drops what it is given, and the next buffer filled
faults its pages in.
"""

from __future__ import annotations

import torch

from . import libc
from .page_release import drop_pages, whole_pages_of

#: flags of mremap(2)
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4
#: None where the C library has no mremap (not Linux): the reserve then drops what it is given
_MOVE = libc.mremap


class PageReserve:
    """Released page ranges, parked in place, and moved under the next buffer filled."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        #: parked (address, length) ranges, page-aligned, oldest first
        self._parked: list[tuple[int, int]] = []
        self._moves = _MOVE is not None
        self.moved_bytes = 0  # bytes handed from one buffer to another so far (tests, benchmarks)

    @property
    def nbytes(self) -> int:
        """Bytes parked now (resident, owned by no buffer)."""
        return sum(length for _, length in self._parked)

    def give(self, tensor: torch.Tensor) -> None:
        """``tensor``'s whole pages are released: parked (its values are garbage from now on)."""
        address, length = whole_pages_of(tensor)
        if not length:
            return
        self.reclaim_range(address, length)  # never parked twice
        if not self._moves or not self.capacity:
            drop_pages(address, length)
            return
        self._parked.append((address, length))
        excess = self.nbytes - self.capacity
        while excess > 0:  # the oldest pages go to the kernel
            address, length = self._parked[0]
            dropped = min(length, -(-excess // libc.PAGE) * libc.PAGE)
            drop_pages(address, dropped)
            if dropped == length:
                self._parked.pop(0)
            else:
                self._parked[0] = (address + dropped, length - dropped)
            excess -= dropped

    def reclaim(self, tensor: torch.Tensor) -> None:
        """``tensor`` is about to be written: its own parked pages are its own again (nothing else moves)."""
        self.reclaim_range(*whole_pages_of(tensor))

    def fill(self, tensor: torch.Tensor) -> None:
        """``tensor`` is about to be written whole: reclaim its own parked pages, and move parked pages of
        other buffers under the rest of it (newest first: the warmest); what is left faults in."""
        address, length = whole_pages_of(tensor)
        if not length:
            return
        holes = self.reclaim_range(address, length)
        for start, size in holes:
            while size and self._parked and self._moves:
                source, available = self._parked.pop()
                moved = min(size, available)
                if not self._move(source + available - moved, start, moved):
                    drop_pages(source, available)  # moves are off from now on: nothing stays parked
                    return
                if moved < available:
                    self._parked.append((source, available - moved))
                start, size = start + moved, size - moved

    def hand_over(self, source: torch.Tensor, target: torch.Tensor) -> bool:
        """``target`` takes ``source``'s values, and ``source``'s pages with them: the whole pages move
        under ``target`` and the partial page at either end is copied (its other bytes belong to the
        neighbours).  ``source`` keeps its address; its whole pages are gone (it reads as zeros) until it
        is filled or handed pages again.  False, with nothing done, where pages cannot move: moves are
        off, the two differ in size, or they lie at different offsets within a page (the caller copies)."""
        size = source.element_size()
        if (not self._moves or source.dtype != target.dtype or source.numel() != target.numel()
                or (source.data_ptr() - target.data_ptr()) % libc.PAGE):
            return False
        address, length = whole_pages_of(source)
        if not length:
            return False
        destination = target.data_ptr() + (address - source.data_ptr())
        self.reclaim_range(address, length)  # neither range may stay parked under live values
        self.reclaim_range(destination, length)
        if not self._move(address, destination, length):
            return False
        head = (address - source.data_ptr()) // size
        tail = head + length // size
        with torch.no_grad():
            target[:head].copy_(source[:head])
            target[tail:].copy_(source[tail:])
        return True

    def reclaim_range(self, address: int, length: int) -> list[tuple[int, int]]:
        """Un-park whatever lies inside [address, address + length); returns the parts of that range not
        parked (their pages were moved away or dropped: they are holes), in order."""
        end = address + length
        kept: list[tuple[int, int]] = []
        inside: list[tuple[int, int]] = []
        for start, size in self._parked:
            stop = start + size
            if stop <= address or start >= end:
                kept.append((start, size))
                continue
            if start < address:
                kept.append((start, address - start))
            if stop > end:
                kept.append((end, stop - end))
            inside.append((max(start, address), min(stop, end)))
        self._parked = kept
        holes, cursor = [], address
        for start, stop in sorted(inside):
            if start > cursor:
                holes.append((cursor, start - cursor))
            cursor = max(cursor, stop)
        if cursor < end:
            holes.append((cursor, end - cursor))
        return holes

    def drop_all(self) -> None:
        """Every parked page to the kernel (the engine closes)."""
        for address, length in self._parked:
            drop_pages(address, length)
        self._parked = []

    def _move(self, source: int, target: int, length: int) -> bool:
        assert _MOVE is not None
        flags = _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP
        if _MOVE(source, length, length, flags, target) != target:
            # an old kernel (no MREMAP_DONTUNMAP): drop what is parked and what is given from now on
            self._moves = False
            self.drop_all()
            return False
        self.moved_bytes += length
        return True
