"""NVMe optimizer offload: the fp32 masters go to swap files while the parameters are being laid out.

The masters of a rank's shard are never all in host memory at once: while the parameter storage is
built, bucket by bucket, each bucket's owned fp32 values are cut into pieces (see
[Note: cutting pieces]) and written to one swap file per piece; the optimizer later reads them a few
pieces at a time (optim/updaters.py).  The pre-flight check runs before the first byte is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .preflight import preflight_nvme
from .swap_files import SwapFile, SwapSpace

if TYPE_CHECKING:
    from ..distributed.collectives import Collectives

#: pieces start at multiples of this many elements (see [Note: cutting pieces])
PIECE_ALIGNMENT = 64
#: fp32 tensors per element the optimizer may swap: the master and up to three state tensors
#: (Adam's two moments, and AMSGrad's running maximum)
TENSORS_PER_ELEMENT = 4


def split_pieces(numel: int, size: int) -> list[tuple[int, int]]:
    """(start, numel) of the pieces of a chunk of ``numel`` elements, at most ``size`` each.

    [Note: cutting pieces]
    torch's fused AdamW on CPU processes a tensor in SIMD vectors from its first element, with a
    scalar loop for the last few, and the two paths may round differently.  Cutting a chunk into
    pieces at multiples of 64 elements (a multiple of every vector width) keeps each element on the
    path it takes when the whole chunk is stepped at once: offloaded updates stay bitwise equal.
    """
    size = max(PIECE_ALIGNMENT, size // PIECE_ALIGNMENT * PIECE_ALIGNMENT)
    return [(s, min(size, numel - s)) for s in range(0, numel, size)] or [(0, 0)]


class MasterSwap(SwapSpace):
    """The per-piece master files of NVMe optimizer offload (and, later, their state files)."""

    def __init__(self, spans: list[tuple[int, int]], nvme_path: str, config_key: str, buffer_count: int,
                 sub_group_size: int, comm: "Collectives") -> None:
        """``spans``: per bucket, the (start, end) of the owned range inside the bucket."""
        self.pieces = [split_pieces(end - start, sub_group_size) for start, end in spans]
        owned = sum(end - start for start, end in spans)
        largest = max(n for pieces in self.pieces for _, n in pieces)
        self.buffer_count = buffer_count
        preflight_nvme(comm, nvme_path, config_key, TENSORS_PER_ELEMENT * owned * 4,
                       buffer_count * TENSORS_PER_ELEMENT * largest * 4)
        super().__init__(nvme_path, comm.world.rank, "optimizer")
        self.files: dict[tuple[int, int], SwapFile] = {
            (b, s): self.file(f"b{b}_{s}.param", n * 4)
            for b, pieces in enumerate(self.pieces) for s, n in pieces}

    def state_file(self, bucket: int, start: int, numel: int, key: str) -> SwapFile:
        return self.file(f"b{bucket}_{start}.{key}", numel * 4)

    def write_owned(self, bucket: int, owned: torch.Tensor) -> None:
        """Write bucket ``bucket``'s owned fp32 values (1D) into its pieces' files (in order with queued I/O)."""
        for start, n in self.pieces[bucket]:
            self.io.write(self.files[(bucket, start)], owned[start: start + n].contiguous()).result()

    def read_owned(self, bucket: int) -> torch.Tensor:
        pieces = self.pieces[bucket]
        out = torch.empty(sum(n for _, n in pieces), dtype=torch.float32)
        for start, n in pieces:
            self.io.read(self.files[(bucket, start)], out[start: start + n]).result()
        return out
