"""Where stage 3 keeps this rank's chunk of each bucket: on the device, in host memory, or on NVMe.

[Note: parameter offload]
Without ``offload_param`` every chunk sits in one device tensor.  With ``device: cpu`` the chunks of
non-persistent buckets sit in host memory (page-locked with ``pin_memory`` on CUDA) and are copied
into the device's full buffer only for their all-gather.  With ``device: nvme`` the first chunks, up to
``max_in_cpu`` elements, stay in host memory and the rest live in swap files: a gather reads the
chunk straight into the full buffer's own slot (through a staging buffer when the device is a GPU),
and an update writes the rounded values back from a staging buffer (``buffer_count`` buffers of
``buffer_size`` elements: writes in flight are bounded by them).  Reads and writes share one I/O
thread in submission order, so a gather always reads the last update.  Persistent buckets are
whole on every rank anyway and stay on the device.
"""

from __future__ import annotations

import weakref
from collections import deque
from concurrent.futures import Future
from typing import Optional

import torch

from ..config.schema import OffloadParamConfig
from ..distributed.collectives import Collectives
from ..offload import OffloadIOError, SwapDirectory, SwapFile, SwapIO, preflight_nvme
from .buffer_pool import BufferPool
from .layout import BucketLayout, FlatLayout


class ShardStore:
    """This rank's chunks of every bucket, each in its place (device, host or NVMe)."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device, persistent: frozenset[int],
                 offload: OffloadParamConfig, comm: Collectives) -> None:
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.where: dict[int, str] = {}
        in_cpu = 0
        for bucket in layout.buckets:
            if offload.device == "none" or bucket.index in persistent:
                self.where[bucket.index] = "device"
            elif offload.device == "cpu" or in_cpu + bucket.shard_numel <= offload.max_in_cpu:
                self.where[bucket.index] = "host"
                in_cpu += bucket.shard_numel
            else:
                self.where[bucket.index] = "nvme"
        self._offset: dict[int, int] = {}
        sizes = {"device": 0, "host": 0}
        for bucket in layout.buckets:
            place = self.where[bucket.index]
            if place in sizes:
                self._offset[bucket.index] = sizes[place]
                sizes[place] += bucket.shard_numel
        self.device_shard = torch.zeros(sizes["device"], dtype=dtype, device=device)  # 1D: own chunks
        self.host_shard = torch.zeros(sizes["host"], dtype=dtype)
        if offload.pin_memory and torch.cuda.is_available() and sizes["host"]:
            self.host_shard = self.host_shard.pin_memory()
        self._files: dict[int, SwapFile] = {}
        #: the first swap failure, held until the engine raises it on every rank together
        self.failure: Optional[OffloadIOError] = None
        self._io: Optional[SwapIO] = None
        self._writes: deque[tuple[Future[None], torch.Tensor]] = deque()
        nvme = [b for b in layout.buckets if self.where[b.index] == "nvme"]
        if nvme:
            self._open_nvme(nvme, offload, comm)

    def _open_nvme(self, buckets: list[BucketLayout], offload: OffloadParamConfig, comm: Collectives) -> None:
        size = torch.empty((), dtype=self.dtype).element_size()
        largest = max(b.shard_numel for b in buckets)
        if largest > offload.buffer_size:
            raise ValueError(f"zero_optimization.offload_param.buffer_size is {offload.buffer_size:,} elements but "
                             f"a bucket's shard has {largest:,}: raise buffer_size to at least that, or lower "
                             f"reduce_bucket_size")
        disk = sum(b.shard_numel for b in buckets) * size
        staging = min(offload.buffer_size, largest)
        preflight_nvme(comm, offload.nvme_directory, "zero_optimization.offload_param.nvme_path", disk,
                       offload.buffer_count * staging * size)
        swap = SwapDirectory(offload.nvme_directory, comm.world.rank, "params")
        self._io = SwapIO()
        self._finalizer = weakref.finalize(self, _close, self._io, swap)
        self._swap = swap
        self._staging = BufferPool(staging, self.dtype, torch.device("cpu"))
        self._buffer_count = offload.buffer_count
        for bucket in buckets:
            self._files[bucket.index] = swap.file(f"b{bucket.index}.shard", bucket.shard_numel * size)

    # ------------------------------------------------------------------ access
    def view(self, bucket: BucketLayout) -> Optional[torch.Tensor]:
        """The chunk itself when it is resident (device or host), else None."""
        place = self.where[bucket.index]
        if place == "nvme":
            return None
        shard = self.device_shard if place == "device" else self.host_shard
        start = self._offset[bucket.index]
        return shard[start: start + bucket.shard_numel]

    def read_into(self, bucket: BucketLayout, into: torch.Tensor) -> None:
        """Copy the chunk into ``into`` (the full buffer's own slot, on the device)."""
        resident = self.view(bucket)
        if resident is not None:
            into.copy_(resident, non_blocking=resident.is_pinned())
            return
        assert self._io is not None
        try:
            if into.device.type == "cpu":
                self._io.read(self._files[bucket.index], into).result()
                return
            staging = self._staging.acquire(bucket.shard_numel)
            try:
                self._io.read(self._files[bucket.index], staging).result()
                into.copy_(staging)
            finally:
                self._staging.release(staging)
        except OffloadIOError as err:
            # Zeros, and the collective goes on: stopping here would leave the other ranks waiting in
            # this all-gather.  The engine raises on every rank before anything is updated.
            self.failure = self.failure or err
            into.zero_()

    def write(self, bucket: BucketLayout, start: int, values: torch.Tensor) -> None:
        """Store ``values`` (any float dtype) at element ``start`` of the chunk, rounded to the shard dtype."""
        resident = self.view(bucket)
        if resident is not None:
            resident[start: start + values.numel()].copy_(values)
            return
        assert self._io is not None
        while len(self._writes) >= self._buffer_count:  # bounded staging: wait for the oldest write
            self._finish_oldest_write()
        staging = self._staging.acquire(values.numel())
        staging.copy_(values)
        size = staging.element_size()
        self._writes.append((self._io.write(self._files[bucket.index], staging, start * size), staging))

    def _finish_oldest_write(self) -> None:
        future, staging = self._writes.popleft()
        try:
            future.result()
        except OffloadIOError as err:
            self.failure = self.failure or err
        finally:
            self._staging.release(staging)

    def take_failure(self) -> Optional[OffloadIOError]:
        failure, self.failure = self.failure, None
        return failure

    def flush(self) -> None:
        """Wait for every write (a failure is kept in ``failure``)."""
        while self._writes:
            self._finish_oldest_write()

    def close(self) -> None:
        """Flush and remove the swap files (also done at exit)."""
        if self._io is not None:
            self.flush()
            self._finalizer()

    # ------------------------------------------------------------------ accounting
    def real_numel_at(self, place: str, rank: int) -> int:
        return sum(b.real_numel_in_shard(rank) for b in self.layout.buckets if self.where[b.index] == place)


def _close(io: SwapIO, swap: SwapDirectory) -> None:
    io.shutdown()
    swap.remove()
