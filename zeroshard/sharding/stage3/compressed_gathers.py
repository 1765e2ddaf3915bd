"""What stage 3's storage asks of a gather that moves fewer bytes than the parameters' own: FP8 layers'
weights in e4m3 (``fp8_gathers.py``) or every weight in int8 blocks (ZeRO++'s qwZ, ``quantised_gathers.py``).

[Note: one seam for compressed gathers]
Both compress the same thing, a gather for compute, in the same three moves: each rank packs its
chunk, the all-gather moves the packed chunks, and each rank unpacks them into the bucket's full
buffer when the gather is waited for.  So the storage holds one ``CompressedGathers`` and knows two
things about it: which buckets it covers, and whether it rewrites this rank's own slot.  FP8 keeps the
own slot's exact values (the layer's cast finds the same bytes either way), so the chunk may still be
lent to the slot; qwZ dequantises the own slot too, so that every rank computes with the same weights,
and the store then keeps the only exact copy: the chunk is not lent, and whatever needs the exact
values (the packing of a joined gather, an exact gather for a save) reads them from the store.  A
config that asks for both is refused, since both would claim the FP8 layers' buckets.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from ...distributed.collectives import Collectives, PendingCollective

__all__ = ["CompressedGathers", "packed_all_gather"]


class CompressedGathers(Protocol):
    """Gathers for compute of some buckets in a packed form (see [Note: one seam for compressed gathers])."""

    #: the name of its buffers in ``memory_breakdown()``
    memory_key: str
    #: whether unpacking writes this rank's own slot too (then the slot is not the exact chunk)
    rewrites_own_slot: bool

    def covers(self, index: int) -> bool:
        """Whether bucket ``index`` is gathered packed for compute."""

    def buffer_bytes(self) -> int:
        """The largest gather's packed buffers (this rank's chunk and every rank's), held while it runs."""

    def gather(self, comm: Collectives, index: int, rank: int, own: torch.Tensor, label: str,
               into: Optional[torch.Tensor]) -> tuple[PendingCollective, Callable[[], None]]:
        """Pack ``own`` (this rank's exact chunk) and start the all-gather; returns it in flight and what to
        run once it is done: unpack into ``into`` (the full buffer), or nothing without it (a rank that joins
        the others' gather)."""


def packed_all_gather(comm: Collectives, packed: torch.Tensor, world_size: int, label: str,
                      unpack_chunk: Optional[Callable[[int, torch.Tensor], None]]
                      ) -> tuple[PendingCollective, Callable[[], None]]:
    """Start the all-gather of every rank's packed chunk (``packed``: this rank's, 1D uint8, the same size on
    every rank); returns it in flight and what to run once it is done: ``unpack_chunk(rank, chunk)`` for
    each rank's chunk, or nothing without it."""
    size = packed.numel()
    gathered = torch.empty(size * world_size, dtype=torch.uint8, device=packed.device)
    pending = comm.all_gather(gathered, packed, label, async_op=True)
    kept = [packed]

    def finish() -> None:
        del kept[:]  # ``packed`` held until the gather is done: the ring sends from it
        if unpack_chunk is None:
            return
        with torch.no_grad():
            for rank in range(world_size):
                unpack_chunk(rank, gathered[rank * size:(rank + 1) * size])
    return pending, finish
