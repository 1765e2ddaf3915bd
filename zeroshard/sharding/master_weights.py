"""fp32 master weights: the values the optimizer really updates when the model computes in 16 bits.

Only the part this rank's optimizer owns exists (stages 1-3: its chunk of every bucket, 4Ψ/N bytes;
stage 0: every bucket whole).  The masters are filled from the parameters' *original* values while
the parameter storage is built, before anything is rounded to 16 bits, so a bf16 run starts from
exactly the weights an fp32 run starts from.
"""

from __future__ import annotations

import torch

from typing import Optional

from ..offload.policy import MasterSwap
from .layout import BucketLayout, FlatLayout, ShardRanks


def owned_spans(layout: FlatLayout, ranks: ShardRanks, whole_buckets: bool) -> list[tuple[int, int]]:
    """Per bucket, [start, end) of what the rank's optimizer owns, relative to the bucket."""
    return [(0, b.padded_numel) if whole_buckets else b.shard_range(ranks.of(b)) for b in layout.buckets]


class MasterWeights:
    """One fp32 buffer holding this rank's owned range of every bucket, one view per bucket; or, under
    NVMe optimizer offload (``spill``), no buffer at all: values go straight to swap files."""

    def __init__(self, layout: FlatLayout, ranks: ShardRanks, whole_buckets: bool, device: torch.device,
                 pin_memory: bool = False, spill: Optional[MasterSwap] = None) -> None:
        """``pin_memory``: page-locked (allocated so, not copied) for asynchronous copies to and from a
        GPU; the caller decides it (host masters on a run whose device pins host memory)."""
        self.layout = layout
        self._ranges = owned_spans(layout, ranks, whole_buckets)
        self._offsets: list[int] = []
        total = 0
        for start, end in self._ranges:
            self._offsets.append(total)
            total += end - start
        self.spill = spill
        self.data = torch.zeros(0 if spill is not None else total, dtype=torch.float32, device=device,
                                pin_memory=pin_memory and spill is None)

    def chunk(self, bucket: BucketLayout) -> torch.Tensor:
        return self.view_of(self.data, bucket)

    def view_of(self, tensor: torch.Tensor, bucket: BucketLayout) -> torch.Tensor:
        """``bucket``'s part of a 1D tensor laid out like the masters (e.g. offloaded gradients)."""
        start, end = self._ranges[bucket.index]
        offset = self._offsets[bucket.index]
        return tensor[offset: offset + end - start]

    def take(self, bucket: BucketLayout, full: torch.Tensor, only_changed: bool = False) -> None:
        """Set the masters of ``bucket`` from its full values (1D, padded, any float dtype).

        ``only_changed``: the values were edited in the parameters' dtype (GatheredParameters); an
        element whose rounded master still equals it keeps its unrounded fp32 master.
        """
        start, end = self._ranges[bucket.index]
        owned = full[start:end]
        with torch.no_grad():
            if not only_changed:
                if self.spill is None:
                    self.chunk(bucket).copy_(owned)
                else:
                    self.spill.write_owned(bucket.index, owned.to(torch.float32).contiguous())
                return
            # in memory the chunk is edited in place; on NVMe a copy is edited and written back
            values = self.spill.read_owned(bucket.index) if self.spill is not None else self.chunk(bucket)
            changed = owned != values.to(owned.dtype)
            values[changed] = owned[changed].to(torch.float32)
            if self.spill is not None:
                self.spill.write_owned(bucket.index, values)
