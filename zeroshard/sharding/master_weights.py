"""fp32 master weights: the values the optimizer really updates when the model computes in 16 bits.

Only the part this rank's optimizer owns exists (stages 1-3: its chunk of every bucket, 4Ψ/N bytes;
stage 0: every bucket whole).  The masters are filled from the parameters' *original* values while
the parameter storage is built, before anything is rounded to 16 bits, so a bf16 run starts from
exactly the weights an fp32 run starts from.
"""

from __future__ import annotations

import torch

from .layout import BucketLayout, FlatLayout


class MasterWeights:
    """One fp32 buffer holding this rank's owned range of every bucket, one view per bucket."""

    def __init__(self, layout: FlatLayout, rank: int, whole_buckets: bool, device: torch.device,
                 pin_memory: bool = False) -> None:
        self.layout = layout
        self.rank = rank
        self.whole_buckets = whole_buckets
        self._ranges = [(0, b.padded_numel) if whole_buckets else b.shard_range(rank) for b in layout.buckets]
        self._offsets: list[int] = []
        total = 0
        for start, end in self._ranges:
            self._offsets.append(total)
            total += end - start
        self.data = torch.zeros(total, dtype=torch.float32, device=device)
        if pin_memory and device.type == "cpu" and torch.cuda.is_available():
            self.data = self.data.pin_memory()  # page-locked: asynchronous copies to and from the GPU

    def owned_range(self, bucket: BucketLayout) -> tuple[int, int]:
        """[start, end) of the owned elements, relative to the bucket."""
        return self._ranges[bucket.index]

    def chunk(self, bucket: BucketLayout) -> torch.Tensor:
        return self.view_of(self.data, bucket)

    def view_of(self, tensor: torch.Tensor, bucket: BucketLayout) -> torch.Tensor:
        """``bucket``'s part of a 1D tensor laid out like the masters (e.g. offloaded gradients)."""
        start, end = self._ranges[bucket.index]
        offset = self._offsets[bucket.index]
        return tensor[offset: offset + end - start]

    def release(self) -> None:
        """Free the values (NVMe offload keeps them in swap files); the layout stays."""
        self.data = torch.empty(0, dtype=torch.float32)

    def take(self, bucket: BucketLayout, full: torch.Tensor) -> None:
        """Set the masters of ``bucket`` from its full values (1D, padded, any float dtype)."""
        start, end = self._ranges[bucket.index]
        with torch.no_grad():
            self.chunk(bucket).copy_(full[start:end])

    def real_numel(self) -> int:
        """Elements that hold parameters (the rest is bucket padding)."""
        if self.whole_buckets:
            return self.layout.numel
        return self.layout.real_numel_in_shard(self.rank)
