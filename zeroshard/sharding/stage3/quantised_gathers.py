"""ZeRO++'s qwZ: stage 3 gathers parameters for compute as int8 blocks, each rank's chunk quantised by
itself (``zero_quantized_weights``, or ``zero_quantized_nontrainable_weights`` for frozen buckets only).

[Note: gathering weights in int8 blocks]
Each rank quantises its own chunk of a bucket in blocks of ``zero_quantized_block_size`` elements
(zeroshard/quantize/blocks.py: symmetric int8, one fp32 scale per block), so no rank waits for another
before it packs, unlike FP8's agreed per-tensor scale; the chunks are all the same size (a bucket is
padded to a multiple of the ranks), so every rank's packed chunk is ``payload + scales`` bytes and the
all-gather moves exactly those.  Blocks run over the chunk, across parameter boundaries and into the
padding: a block's error is bounded by half a step of its own amax whatever it holds.  When the gather
is waited for, each rank dequantises the other ranks' chunks into the bucket's full buffer, and its own
chunk too, from what it packed, as soon as that is packed (the gather runs meanwhile), so all ranks
compute with the same weights (see [Note: one seam for compressed gathers] in
sharding/stage3/compressed_gathers.py for what that asks of the storage).  Masters, optimizer state
and the stored chunks never see the quantisation: the optimizer steps the exact chunk, and gathers for
anything but compute (saves, ``GatheredParameters``, ``full_state_dict``) are exact.  With hpZ the
gather over all ranks is the quantised one (it is the one that crosses nodes); the secondary partition
is cut from the dequantised full buffer, so the later gathers of the step, inside the node, move the
parameters' own dtype and give the same values as the first.
"""

from __future__ import annotations

from typing import Callable, Collection, Optional

import torch

from ...config import ZeroConfig
from ...distributed.collectives import Collectives, PendingCollective
from ...quantize import BlockFormat, pack, packed_bytes, unpack
from ..layout import BucketLayout, FlatLayout
from .compressed_gathers import packed_all_gather

__all__ = ["QuantisedGathers", "qwz_gathers"]


class QuantisedGathers:
    """The buckets stage 3 gathers as int8 blocks for compute, and the gather (see [Note: gathering weights
    in int8 blocks])."""

    memory_key = "qwz_gather_buffers"
    rewrites_own_slot = True

    def __init__(self, buckets: Collection[BucketLayout], fmt: BlockFormat) -> None:
        self.buckets = {bucket.index: bucket for bucket in buckets}
        self.format = fmt

    def covers(self, index: int) -> bool:
        return index in self.buckets

    def packed(self, bucket: BucketLayout) -> int:
        """Bytes of one rank's packed chunk of ``bucket``."""
        return packed_bytes(bucket.shard_numel, self.format)

    def buffer_bytes(self) -> int:
        return max(((b.world_size + 1) * self.packed(b) for b in self.buckets.values()), default=0)

    def gather(self, comm: Collectives, index: int, rank: int, own: torch.Tensor, label: str,
               into: Optional[torch.Tensor]) -> tuple[PendingCollective, Callable[[], None]]:
        bucket = self.buckets[index]
        shard = bucket.shard_numel

        def unpack_chunk(other: int, chunk: torch.Tensor) -> None:
            assert into is not None
            if other != rank:  # this rank's own slot is written as soon as the gather is launched
                unpack(chunk, shard, self.format, into[other * shard:(other + 1) * shard])
        with torch.no_grad():
            packed = pack(own, self.format)  # 1D uint8: payload, then scales
            pending, finish = packed_all_gather(comm, packed, bucket.world_size, f"{label}.qwz",
                                                unpack_chunk if into is not None else None)
            if into is not None:
                unpack(packed, shard, self.format, into[rank * shard:(rank + 1) * shard])
        return pending, finish


def qwz_gathers(layout: FlatLayout, persistent: Collection[int], zero: ZeroConfig) -> Optional[QuantisedGathers]:
    """The qwZ gathers the config asks for over ``layout``'s sharded buckets (None: none): every bucket with
    ``zero_quantized_weights``, the frozen ones with ``zero_quantized_nontrainable_weights``."""
    if not (zero.zero_quantized_weights or zero.zero_quantized_nontrainable_weights):
        return None
    chosen = [b for b in layout.buckets if b.index not in persistent and (zero.zero_quantized_weights or b.frozen)]
    return QuantisedGathers(chosen, BlockFormat(8, zero.zero_quantized_block_size))
