"""Stage 3 gathers of FP8 layers' weights in FP8: each rank sends one byte per weight element.

[Note: gathering FP8 weights in FP8]
A bucket that holds FP8 layers' weights (``fp8.gather_weights_in_fp8``) is gathered for compute in
three moves.  The ranks first agree on one scale per weight: each takes the amax of its elements of
the weight, and an all-reduce (MAX) over the shard group gives the amax of the whole tensor, from
which every rank computes the scale torchao's tensorwise recipe computes at the layer
(``e4m3's max / amax``, in fp64 then fp32).  Each rank then packs its chunk: a weight's elements cast
to e4m3 with that scale (one byte each), the bucket's padding as zero bytes, and any other parameter's
elements in their own dtype; the all-gather moves the packed chunks, the same size on every rank (the
largest), so a bucket of FP8 weights alone moves exactly half of bf16's bytes.  Last, each rank
dequantises the others' chunks into the bucket's full buffer; its own slot keeps its exact values.
The all-gather runs in the background like any other (a prefetch overlaps it with compute); the
dequantising runs when the gather is waited for.

The layer then casts the gathered weight to FP8 again, dynamically, as without these gathers, and gets
the same bytes: the dequantised weight's amax is the agreed one (448 / scale rounds back to the amax,
a value of the parameter's dtype), so the layer's scale is the agreed scale, and each dequantised
element requantises to its own e4m3 value (its rounding in the parameter's dtype moves it by at most
2**-8 of itself, far inside e4m3's half spacing of 2**-4); the own slot's exact values quantise as the
sender's would.  So training is the same as with high-precision gathers, which the tests check.  The
layer is not handed the FP8 tensor itself: torchao's FP8 weight subclass is FSDP2's, built around
its parameter, while zeroshard's parameters are views of a bucket's buffer that autograd and the
gradient hooks keep; dequantising costs one elementwise pass per gathered bucket.  Only the recipe
whose weight scale is one per tensor (``tensorwise``) can reuse a gathered weight: the rowwise recipe
scales the weight along one axis for the forward and along the other for the input gradient.

Gathers for anything but compute (saves, ``GatheredParameters``, ``full_state_dict``) are exact: a
bucket that an FP8 gather left in place is gathered again in its own dtype first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Optional

import torch

from ...distributed.collectives import Collectives, PendingCollective
from ..layout import BucketLayout
from .compressed_gathers import packed_all_gather

__all__ = ["Fp8Gathers", "Fp8BucketPlan"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
#: a segment's kind other than a weight's scale index: elements of another parameter, or padding
OTHER, PAD = -1, -2


@dataclass(frozen=True)
class Segment:
    """Elements [lo, hi) of a bucket, all of one kind: weight ``kind``'s (its scale's index), OTHER or PAD."""

    lo: int
    hi: int
    kind: int

    def packed_bytes(self, itemsize: int) -> int:
        return (self.hi - self.lo) * (itemsize if self.kind == OTHER else 1)


class Fp8BucketPlan:
    """How one bucket's chunks are packed: each rank's segments and the packed size every rank sends."""

    def __init__(self, bucket: BucketLayout, weights: Collection[int], itemsize: int) -> None:
        self.bucket = bucket
        self.weights = [slot for slot in bucket.slots if slot.index in weights]  # in scale order
        kinds = {slot.index: i for i, slot in enumerate(self.weights)}
        marks = [(slot.offset, slot.offset + slot.numel, kinds.get(slot.index, OTHER)) for slot in bucket.slots]
        self.itemsize = itemsize
        self.segments = [self._cut(marks, *bucket.shard_range(r)) for r in range(bucket.world_size)]
        self.packed = max(sum(s.packed_bytes(itemsize) for s in segs) for segs in self.segments)

    @staticmethod
    def _cut(marks: list[tuple[int, int, int]], start: int, end: int) -> list[Segment]:
        """The segments of [start, end): the slots' parts inside it, the gaps between as padding."""
        out, at = [], start
        for lo, hi, kind in sorted(marks):
            lo, hi = max(lo, start), min(hi, end)
            if lo >= hi:
                continue
            if lo > at:
                out.append(Segment(at, lo, PAD))
            out.append(Segment(lo, hi, kind))
            at = hi
        if at < end:
            out.append(Segment(at, end, PAD))
        return out

    def local_amax(self, own: torch.Tensor, rank: int) -> torch.Tensor:
        """Each weight's amax over this rank's elements (0 where it has none), fp32."""
        amax = torch.zeros(len(self.weights), dtype=torch.float32, device=own.device)
        start = self.bucket.shard_range(rank)[0]
        for seg in self.segments[rank]:
            if seg.kind >= 0:
                piece = own[seg.lo - start: seg.hi - start]
                amax[seg.kind] = torch.maximum(amax[seg.kind], piece.abs().max().float())
        return amax

    def pack(self, own: torch.Tensor, rank: int, scales: torch.Tensor) -> torch.Tensor:
        """This rank's chunk as bytes: weights in e4m3, padding as zeros, the rest as they are."""
        out = torch.zeros(self.packed, dtype=torch.uint8, device=own.device)
        start, at = self.bucket.shard_range(rank)[0], 0
        for seg in self.segments[rank]:
            size = seg.packed_bytes(self.itemsize)
            piece = own[seg.lo - start: seg.hi - start]
            if seg.kind == OTHER:
                out[at: at + size] = piece.contiguous().view(torch.uint8)
            elif seg.kind >= 0:
                quantised = (piece.float() * scales[seg.kind]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
                out[at: at + size] = quantised.view(torch.uint8)
            at += size
        return out

    def unpack(self, packed: torch.Tensor, rank: int, scales: torch.Tensor, into: torch.Tensor) -> None:
        """Rank ``rank``'s packed chunk, dequantised, into its slot of the full buffer ``into``."""
        at = 0
        for seg in self.segments[rank]:
            size = seg.packed_bytes(self.itemsize)
            target = into[seg.lo: seg.hi]
            raw = packed[at: at + size]
            if seg.kind == OTHER:
                target.copy_(raw.view(into.dtype))
            elif seg.kind >= 0:
                target.copy_(raw.view(E4M3).float() / scales[seg.kind])
            else:
                target.zero_()
            at += size


def scales_of(amax: torch.Tensor) -> torch.Tensor:
    """torchao's tensorwise scale of each amax: e4m3's max over it, in fp64 then fp32."""
    return (E4M3_MAX / amax.double().clamp(min=1e-12)).float()


class Fp8Gathers:
    """Which buckets stage 3 gathers in FP8 for compute, and the gather itself (see [Note: gathering FP8
    weights in FP8]); a :class:`~.compressed_gathers.CompressedGathers`."""

    memory_key = "fp8_gather_buffers"
    rewrites_own_slot = False  # the own slot keeps its exact values

    def __init__(self, buckets: Collection[BucketLayout], weights: Collection[int], itemsize: int) -> None:
        plans = (Fp8BucketPlan(bucket, weights, itemsize) for bucket in buckets)
        self.plans = {plan.bucket.index: plan for plan in plans if plan.weights}

    def covers(self, index: int) -> bool:
        return index in self.plans

    def buffer_bytes(self) -> int:
        """The largest gather's packed buffers (this rank's chunk and every rank's), held while it runs."""
        return max(((plan.bucket.world_size + 1) * plan.packed for plan in self.plans.values()), default=0)

    def gather(self, comm: Collectives, index: int, rank: int, own: torch.Tensor, label: str,
               into: Optional[torch.Tensor]) -> tuple[PendingCollective, Callable[[], None]]:
        """Agree on the scales and start the all-gather of the packed chunks; returns it in flight and what
        to run once it is done: with ``into`` (the full buffer), dequantise the other ranks' chunks into it;
        without it (a rank that joins others' gather), nothing."""
        plan = self.plans[index]
        with torch.no_grad():
            amax = plan.local_amax(own, rank)
            comm.all_reduce(amax, f"{label}.fp8_amax", op=torch.distributed.ReduceOp.MAX)
            scales = scales_of(amax)
            packed = plan.pack(own, rank, scales)

        def unpack_chunk(other: int, chunk: torch.Tensor) -> None:
            if other != rank:  # this rank's slot holds its exact chunk already
                assert into is not None
                plan.unpack(chunk, other, scales, into)
        return packed_all_gather(comm, packed, plan.bucket.world_size, f"{label}.fp8",
                                 unpack_chunk if into is not None else None)
