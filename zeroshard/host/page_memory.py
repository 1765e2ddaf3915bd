"""Buffer memory in host memory on Linux: pages released, parked and moved, buffers kept in place.

The host's :class:`~zeroshard.host.buffer_memory.BufferMemory`: a buffer keeps its address for the
run and gives back its pages when released (``madvise``: [Note: releasing a gathered unit's pages] in
host/page_release.py); released pages are parked in a :class:`~.page_reserve.PageReserve` and moved under
the next buffer refilled ([Note: released pages move to the next gather] in host/page_reserve.py).
Where it serves (:meth:`HostPageMemory.serves`) and ``zero_optimization.host_page_reuse`` is on, the
engine chooses it ([Note: one buffer memory per engine] in host/buffer_memory.py).
"""

from __future__ import annotations

import torch

from .buffer_memory import BufferMemory
from .page_release import can_release_pages, held_bytes, prefer_huge_pages, release_pages
from .page_reserve import PageReserve


class HostPageMemory(BufferMemory):
    """Released pages parked in one reserve, whence the next buffer refilled takes them."""

    releases_pages = True

    def __init__(self) -> None:
        #: parks nothing until a storage says how much one forward takes back (:meth:`park_up_to`)
        self.reserve = PageReserve(0)

    @staticmethod
    def serves(device: torch.device) -> bool:
        """Whether memory on ``device`` can give back its pages in place (host memory on Linux)."""
        return can_release_pages(torch.empty(0, device=device))

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """No page is resident until written (the heap may have handed out some that were)."""
        buffer = torch.empty(numel, dtype=dtype, device=device)
        release_pages(buffer)
        prefer_huge_pages(buffer)
        return buffer

    def keep_for_run(self, tensor: torch.Tensor) -> None:
        prefer_huge_pages(tensor)

    def release(self, tensor: torch.Tensor) -> None:
        """Parked (beyond the reserve's capacity, dropped)."""
        self.reserve.give(tensor)

    def drop(self, tensor: torch.Tensor) -> None:
        self.reserve.reclaim(tensor)  # nothing of it stays parked over dropped pages
        release_pages(tensor)

    def refill(self, tensor: torch.Tensor) -> None:
        """Its own parked pages back, parked pages of other buffers moved under the rest; what is left
        faults in as it is written."""
        self.reserve.fill(tensor)

    def forget(self, tensor: torch.Tensor) -> None:
        self.reserve.reclaim(tensor)

    def hand_over(self, source: torch.Tensor, target: torch.Tensor) -> bool:
        return self.reserve.hand_over(source, target)

    def held_bytes(self, tensor: torch.Tensor) -> int:
        """Resident whole pages (the partial page at either end is not counted)."""
        return held_bytes(tensor)

    @property
    def parked_bytes(self) -> int:
        return self.reserve.nbytes

    def park_up_to(self, nbytes: int) -> None:
        self.reserve.capacity = nbytes

    def drop_all(self) -> None:
        self.reserve.drop_all()
