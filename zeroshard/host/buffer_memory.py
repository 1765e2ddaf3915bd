"""Where the memory of buffers kept for the run goes between their uses: one interface, two homes.

Stage 3 keeps buffers for the whole run (each unit's full buffer, the store's chunks a gathered unit
borrows, each bucket's gradient chunk) whose memory goes when they are idle and comes back when they
are next used, and every stage keeps a pool of bucket buffers.  What "goes" and "comes back" mean
depends on where the memory is, and is decided once, when the engine is built
(``Engine._decide_policies``): every part that holds such buffers (the parameter storage, the
gradient chunks, the pools) is handed the one :class:`BufferMemory` and asks it, never the device.

- :class:`~zeroshard.host.page_memory.HostPageMemory`: host memory on Linux.  A buffer keeps its
  address for the run; a release gives back its pages, parked for the next buffer refilled, and pages
  can move from one buffer to another (see [Note: releasing a gathered unit's pages] in
  host/page_release.py and [Note: released pages move to the next gather] in host/page_reserve.py).
- :class:`DeviceMemory`: a GPU, or host memory with ``zero_optimization.host_page_reuse`` false.  A
  release frees the buffer's storage (``untyped_storage().resize_(0)``: every view keeps its shape)
  and a refill allocates it again; nothing is parked and no pages move.

[Note: one buffer memory per engine]
The two homes differ in every operation on such a buffer, and deciding at each use (is this host
memory on Linux?) would put the same question in every part that holds one, where the answer never
changes within a run.  Asked once, the choice also becomes a setting: ``host_page_reuse: false``
makes a CPU run take exactly the GPU's path, so that the tests, which run on the CPU, cover both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class BufferMemory(ABC):
    """How a buffer kept for the run gets its memory, gives it back while idle, and gets it again."""

    #: True where memory goes and comes back page by page under a buffer that keeps its storage and
    #: address (so a part of a buffer can be released, and pages can move between buffers); False
    #: where a release frees a buffer's whole storage
    releases_pages: bool

    @abstractmethod
    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new 1D buffer kept for the run, its values undefined, holding as little memory as its home
        allows until it is written (host memory: none)."""

    @abstractmethod
    def keep_for_run(self, tensor: torch.Tensor) -> None:
        """``tensor``, made elsewhere, is kept for the run and will be released and refilled: prepare
        its memory for that (host memory asks for huge pages, so that a refill faults 2 MiB at a time)."""

    @abstractmethod
    def release(self, tensor: torch.Tensor) -> None:
        """``tensor``'s memory goes until it is refilled (its values are garbage from then on); it may
        wait for the next buffer refilled (host pages, parked)."""

    @abstractmethod
    def drop(self, tensor: torch.Tensor) -> None:
        """``tensor``'s memory goes back to the system at once, kept for no other buffer."""

    @abstractmethod
    def refill(self, tensor: torch.Tensor) -> None:
        """``tensor`` is about to be written whole: memory under all of it again (its values are
        undefined)."""

    @abstractmethod
    def forget(self, tensor: torch.Tensor) -> None:
        """``tensor`` is about to be freed by its owner: nothing of its memory may wait for reuse."""

    @abstractmethod
    def hand_over(self, source: torch.Tensor, target: torch.Tensor) -> bool:
        """``target`` takes ``source``'s values with the memory under them, ``source`` keeping none of it
        until it is refilled; False, with nothing done, where memory cannot move (the caller copies)."""

    @abstractmethod
    def held_bytes(self, tensor: torch.Tensor) -> int:
        """Memory under ``tensor`` now, measured."""

    @property
    @abstractmethod
    def parked_bytes(self) -> int:
        """Released memory waiting now for the next buffer refilled (owned by no buffer)."""

    @abstractmethod
    def park_up_to(self, nbytes: int) -> None:
        """At most ``nbytes`` of released memory may wait for the next buffer refilled (stage 3: what one
        forward's gathers take); the rest goes back to the system."""

    @abstractmethod
    def drop_all(self) -> None:
        """Everything waiting for reuse goes back to the system (the engine closes)."""


def _whole_storage(tensor: torch.Tensor) -> None:
    """Device memory frees storages, never a part of one: ``tensor`` must be all of its storage (or a
    storage freed already)."""
    nbytes = tensor.untyped_storage().nbytes()
    if nbytes and (tensor.storage_offset() or tensor.numel() * tensor.element_size() != nbytes):
        raise ValueError("device memory is released a whole storage at a time (releases_pages is False): "
                         f"this tensor is {tensor.numel() * tensor.element_size()} bytes at offset "
                         f"{tensor.storage_offset()} of a {nbytes}-byte storage")


class DeviceMemory(BufferMemory):
    """A release frees the buffer's storage and a refill allocates it again (see the module's doc)."""

    releases_pages = False

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def keep_for_run(self, tensor: torch.Tensor) -> None:
        """Nothing to prepare: a refill allocates afresh."""

    def release(self, tensor: torch.Tensor) -> None:
        """The storage shrinks to zero bytes; every view of it keeps its shape."""
        _whole_storage(tensor)
        tensor.untyped_storage().resize_(0)

    def drop(self, tensor: torch.Tensor) -> None:
        """Nothing waits for reuse here: the same as :meth:`release`."""
        self.release(tensor)

    def refill(self, tensor: torch.Tensor) -> None:
        """The storage grows back to what ``tensor`` spans, if it was freed."""
        needed = (int(tensor.storage_offset()) + tensor.numel()) * tensor.element_size()
        if tensor.untyped_storage().nbytes() < needed:
            tensor.untyped_storage().resize_(needed)

    def forget(self, tensor: torch.Tensor) -> None:
        """Nothing waits for reuse here."""

    def hand_over(self, source: torch.Tensor, target: torch.Tensor) -> bool:
        """Storage does not move between tensors: the caller copies."""
        return False

    def held_bytes(self, tensor: torch.Tensor) -> int:
        """The storage's bytes (0 once released)."""
        return tensor.untyped_storage().nbytes()

    @property
    def parked_bytes(self) -> int:
        return 0

    def park_up_to(self, nbytes: int) -> None:
        """Nothing is parked: freed storage goes back to the allocator."""

    def drop_all(self) -> None:
        """Nothing is parked."""
