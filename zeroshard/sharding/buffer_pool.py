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

import torch

from ..host.buffer_memory import BufferMemory


class BufferPool:
    """Hands out 1D views of fixed-capacity buffers, their values undefined (each user writes every
    element it reads: see [Note: filling a stage-2 bucket] in sharding/sharded_grads.py); grows only
    when all are in use.  A buffer comes from ``memory`` holding as little as it can until written (in
    host memory no page), so what its users never write (stage 2's own chunks) never becomes resident."""

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device, memory: BufferMemory) -> None:
        self.capacity = capacity
        self.dtype = dtype
        self.device = device
        self.memory = memory
        self._free: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent view -> its buffer

    def acquire(self, numel: int) -> torch.Tensor:
        """A view of ``numel`` elements (1D), values undefined; give it back with :meth:`release`."""
        if numel > self.capacity:
            raise ValueError(f"buffer of {numel} elements asked from a pool of capacity {self.capacity}")
        if self._free:
            buffer = self._free.pop()
        else:
            buffer = self.memory.empty(self.capacity, self.dtype, self.device)
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
    """One buffer per key, allocated at its first use and kept for the run: :meth:`give_back` releases
    its memory to ``memory`` (in host memory its pages are parked, whence :meth:`take` moves pages back
    in; on a device its storage is freed, and :meth:`take` allocates it again).  Stage 3 keeps each
    bucket's gradient chunk in one ([Note: where gradient chunks live] in sharding/grad_chunks.py)."""

    def __init__(self, device: torch.device, memory: BufferMemory) -> None:
        self.device = device
        self.memory = memory
        self._buffers: dict[int, torch.Tensor] = {}

    def take(self, key: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Buffer ``key`` (1D, ``numel`` elements of ``dtype``); its values are undefined."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() != numel or buffer.dtype != dtype:
            if buffer is not None:
                self.memory.forget(buffer)  # freed: nothing of it may wait for reuse
            buffer = self.memory.empty(numel, dtype, self.device)
            self._buffers[key] = buffer
        self.memory.refill(buffer)
        return buffer

    def give_back(self, key: int) -> None:
        """Buffer ``key``'s memory goes until it is next taken."""
        if key in self._buffers:
            self.memory.release(self._buffers[key])

    def held_bytes(self) -> int:
        """Memory the buffers hold now, measured."""
        return sum(self.memory.held_bytes(b) for b in self._buffers.values())
