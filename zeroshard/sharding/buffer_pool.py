"""Reusable communication buffers.

[Note: why a pool]
Stage 2 needs a full-size buffer for each gradient bucket while it is being filled and reduced, and a
shard-size buffer for each reduce-scatter's result.  Allocating them afresh at every micro step makes
the allocator hand out and reclaim tens of megabytes per step: the kernel zero-fills new pages each
time (slow), and glibc keeps freed blocks of changing sizes (peak RSS grows).  A small pool of
fixed-capacity buffers, reused from step to step, costs a constant, reported amount of memory
(``comm_buffers`` in the breakdown) bounded by the bucket size, not by the model.
"""

from __future__ import annotations

import torch


class BufferPool:
    """Hands out zeroed 1D views of fixed-capacity buffers; grows only when all are in use."""

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.capacity = capacity
        self.dtype = dtype
        self.device = device
        self._free: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent view -> its buffer

    def acquire(self, numel: int) -> torch.Tensor:
        """A zeroed view of ``numel`` elements (1D); give it back with :meth:`release`."""
        if numel > self.capacity:
            raise ValueError(f"buffer of {numel} elements asked from a pool of capacity {self.capacity}")
        if self._free:
            buffer = self._free.pop()
        else:
            buffer = torch.empty(self.capacity, dtype=self.dtype, device=self.device)
            self._all.append(buffer)
        view = buffer[:numel]
        view.zero_()
        self._lent[view.data_ptr()] = buffer
        return view

    def release(self, view: torch.Tensor) -> None:
        self._free.append(self._lent.pop(view.data_ptr()))

    def trim(self) -> None:
        """Give back the buffers not lent out (they are allocated again when next needed)."""
        free = {id(b) for b in self._free}
        self._all = [b for b in self._all if id(b) not in free]
        self._free = []

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (lent or free)."""
        return len(self._all) * self.capacity * torch.empty((), dtype=self.dtype).element_size()
