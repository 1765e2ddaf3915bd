"""Reusable communication buffers.

[Note: why a pool]
Stages 2-3 need a full-size buffer for each gradient bucket while it is being filled and reduced
(stages 0-1 one for each bucket they reduce in another dtype).  Allocating them afresh at every micro
step makes the allocator hand out and reclaim tens of megabytes per step: the kernel zero-fills new
pages each time (slow), and glibc keeps freed blocks of changing sizes (peak RSS grows).  A small pool of
fixed-capacity buffers, reused from step to step, costs a constant, reported amount of memory
(``comm_buffers`` in the breakdown) bounded by the bucket size, not by the model.

The buffers are kept for the run, pages included ([Note: when the bucket pool lets go] in
sharding/sharded_grads.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..host.page_release import can_release_pages, held_bytes, prefer_huge_pages, release_pages
from ..host.page_reserve import PageReserve


class BufferPool:
    """Hands out 1D views of fixed-capacity buffers, their values undefined (each user writes every
    element it reads: see [Note: filling a stage-2 bucket] in sharding/sharded_grads.py); grows only
    when all are in use.  In host memory a buffer's pages are dropped when it is made, so what its
    users never write (stage 2's own chunks) never becomes resident."""

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.capacity = capacity
        self.dtype = dtype
        self.device = device
        self._free: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent view -> its buffer
        self._huge_pages = can_release_pages(torch.empty(0, device=device))  # host memory on Linux

    def acquire(self, numel: int) -> torch.Tensor:
        """A view of ``numel`` elements (1D), values undefined; give it back with :meth:`release`."""
        if numel > self.capacity:
            raise ValueError(f"buffer of {numel} elements asked from a pool of capacity {self.capacity}")
        if self._free:
            buffer = self._free.pop()
        else:
            buffer = torch.empty(self.capacity, dtype=self.dtype, device=self.device)
            if self._huge_pages:  # host memory: no page is resident until written (the heap may reuse some)
                release_pages(buffer)
                prefer_huge_pages(buffer)
            self._all.append(buffer)
        view = buffer[:numel]
        self._lent[view.data_ptr()] = buffer
        return view

    def release(self, view: torch.Tensor) -> None:
        self._free.append(self._lent.pop(view.data_ptr()))

    @property
    def count(self) -> int:
        """Buffers the pool holds (lent or free)."""
        return len(self._all)

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (lent or free)."""
        return len(self._all) * self.capacity * self.dtype.itemsize


class KeptBuffers:
    """One buffer per key, allocated at its first use and kept for the run: :meth:`give_back` drops its
    pages in host memory on Linux (see the Note), or parks them in the page reserve it was given, whence
    :meth:`take` moves pages back in; elsewhere it frees the buffer (and :meth:`take` allocates it
    again).  Stage 3 keeps each bucket's gradient chunk in one ([Note: where gradient chunks live] in
    sharding/grad_chunks.py)."""

    def __init__(self, device: torch.device, reserve: Optional[PageReserve] = None) -> None:
        self.device = device
        self._buffers: dict[int, torch.Tensor] = {}
        #: where given-back pages go (in host memory on Linux): stage 3's reserve, whence a buffer
        #: taken again gets its pages; else a reserve of no capacity, which drops them
        self._pages = (reserve or PageReserve(0)) if can_release_pages(torch.empty(0, device=device)) else None

    def take(self, key: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Buffer ``key`` (1D, ``numel`` elements of ``dtype``); its values are undefined."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() != numel or buffer.dtype != dtype:
            if buffer is not None and self._pages is not None:
                self._pages.reclaim(buffer)  # freed: nothing of it may stay parked
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
            if self._pages is not None:
                prefer_huge_pages(buffer)
            self._buffers[key] = buffer
        if self._pages is not None:
            self._pages.fill(buffer)
        return buffer

    def give_back(self, key: int) -> None:
        """Buffer ``key``'s memory goes back to the system until it is next taken."""
        if self._pages is not None:
            if key in self._buffers:
                self._pages.give(self._buffers[key])
        else:
            self._buffers.pop(key, None)

    def held_bytes(self) -> int:
        """Memory the buffers hold now, measured: resident whole pages, or the buffers' bytes."""
        return sum(held_bytes(b) for b in self._buffers.values())
