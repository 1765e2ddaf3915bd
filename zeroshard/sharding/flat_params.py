"""The flat parameter buffer: every trainable parameter becomes a view into one padded 1D tensor.

Keeping the parameters contiguous lets a bucket be communicated without copies, and lets the
optimizer work on a handful of large chunks instead of hundreds of small tensors.  The ``Parameter``
objects themselves stay the user's (only their ``.data`` is rebound), so references held by the
model, tied weights and hooks all keep working.
"""

from __future__ import annotations

from typing import Callable, Collection, Optional, Sequence

import torch

from ..distributed.collectives import Collectives
from ..host.buffer_memory import BufferMemory
from ..offload.policy import SwapFailure
from .layout import BucketLayout, FlatLayout
from .master_weights import MasterWeights
from .storage import HOMES, CopyGate, NoCopies, ParamHome


def bucket_values(bucket: BucketLayout, values_of: Callable[[int], torch.Tensor], into: torch.Tensor,
                  masters: Optional[MasterWeights]) -> None:
    """Fill ``into`` (a bucket's full 1D buffer) with its parameters' values.

    With ``masters``, the values are first assembled in fp32 so that the masters get them unrounded
    (``into`` may be 16-bit); ``values_of(i)`` gives trainable parameter ``i``'s current values.
    """
    staging = into if masters is None else torch.zeros(bucket.padded_numel, dtype=torch.float32,
                                                       device=into.device)
    for slot in bucket.slots:
        staging[slot.offset: slot.offset + slot.numel].copy_(values_of(slot.index).reshape(-1))
    if masters is not None:
        masters.take(bucket, staging)
        into.copy_(staging)


def check_uniform(params: Sequence[torch.nn.Parameter]) -> None:
    first = params[0]
    for p in params:
        if p.dtype != first.dtype or p.device != first.device:
            raise TypeError(
                f"all trainable parameters must share one dtype and device (found {first.dtype} on "
                f"{first.device} and {p.dtype} on {p.device}); build the model in one dtype (fp32) and "
                f"let the bf16/fp16 config blocks convert it")


class FlatParameters:
    """Owns the padded flat buffer and the views the model's parameters now point into."""

    def __init__(self, layout: FlatLayout, params: Sequence[torch.nn.Parameter], comm: Collectives,
                 buffer_memory: BufferMemory, dtype: Optional[torch.dtype] = None,
                 masters: Optional[MasterWeights] = None, job_comm: Optional[Collectives] = None) -> None:
        first = params[0]
        check_uniform(params)
        self.params = list(params)
        self.layout = layout
        self.comm = comm
        self.job_comm = job_comm or comm
        self.dtype = dtype or first.dtype
        self.device = first.device
        self.masters = masters
        #: the flat buffer is never released; the strategy's bucket pools take their buffers from here
        self.buffer_memory = buffer_memory
        self.copy_gate: CopyGate = NoCopies()
        #: waits until these buckets' values are current (None: all), set by a strategy whose post-step
        #: gather runs into the next forward (see [Note: the parameter gather
        #: runs into the next forward] in sharding/strategy.py)
        self.before_read: Callable[[Optional[Collection[int]]], None] = lambda indices: None
        self.data = torch.zeros(layout.padded_numel, dtype=self.dtype, device=self.device)  # 1D, padded
        with torch.no_grad():
            for bucket in layout.buckets:
                bucket_values(bucket, lambda i: params[i].data, self.bucket_view(bucket), masters)
                for slot in bucket.slots:
                    view = self.slot_view(bucket, slot.offset, slot.numel).view(slot.shape)
                    params[slot.index].data = view
                    HOMES.add(params[slot.index], ParamHome(self, bucket.index, slot.name, self.device))

    def bucket_view(self, bucket: BucketLayout) -> torch.Tensor:
        """The whole bucket, padding included (1D, padded_numel)."""
        return self.data[bucket.offset: bucket.offset + bucket.padded_numel]

    def shard_view(self, bucket: BucketLayout, rank: int) -> torch.Tensor:
        """Rank's equal chunk of the bucket (1D, shard_numel)."""
        start, end = bucket.shard_range(rank)
        return self.data[bucket.offset + start: bucket.offset + end]

    # Every rank holds every bucket whole: gathering and releasing are no-ops (GatheredParameters).
    def gather(self, index: int, label: str, async_op: bool = False) -> None:
        """Nothing to gather at stages 0-2."""

    def release(self, index: int) -> None:
        """Nothing to release at stages 0-2."""

    def pin(self, index: int, label: str) -> None:
        """Nothing to pin at stages 0-2; the bucket's post-step gather has finished on return."""
        self.before_read((index,))

    def unpin(self, index: int) -> None:
        """Nothing to unpin at stages 0-2."""

    @property
    def full(self) -> list[torch.Tensor]:
        self.before_read(None)
        return [self.bucket_view(b) for b in self.layout.buckets]

    def commit_full(self, index: int) -> None:
        """The buffer was modified in place (GatheredParameters): the masters follow it, if any."""
        if self.masters is not None:
            self.masters.take(self.layout.buckets[index], self.bucket_view(self.layout.buckets[index]), only_changed=True)

    def write_own_chunk(self, index: int, chunk: torch.Tensor) -> None:
        """Stages 0-2 keep frozen parameters in their modules: they have no frozen bucket."""
        raise AssertionError("stages 0-2 have no frozen buckets")

    def take_back_chunks(self) -> None:
        """Stages 0-2 lend no chunk: each lives in the one flat buffer."""

    def set_copy_gate(self, gate: CopyGate) -> None:
        """Stages 0-2 lend no chunk: nothing to hold back while it copies."""
        self.copy_gate = gate

    def take_failure(self) -> SwapFailure:
        """Stages 0-2 never swap parameters."""
        return None

    def detach_parameters(self) -> None:
        """Each parameter gets its own copy of its values; the flat buffer can then be freed."""
        with torch.no_grad():
            for p in self.params:
                p.data = p.data.clone()
        HOMES.forget(self.params)

    def close(self) -> None:
        """Nothing to close at stages 0-2."""

    def slot_view(self, bucket: BucketLayout, offset: int, numel: int) -> torch.Tensor:
        start = bucket.offset + offset
        return self.data[start: start + numel]
