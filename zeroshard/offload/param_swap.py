"""NVMe parameter offload: stage 3's shards that live in swap files, read for gathers, written after steps.

A gather reads a shard straight into the full buffer's own slot (through a staging buffer when the
device is a GPU); an update writes the rounded values back from a staging buffer.  ``buffer_count``
staging buffers of ``buffer_size`` elements bound the writes in flight.  Reads and writes share one
I/O thread in submission order, so a gather always reads the last update.

[Note: staging buffers between a GPU and the swap files]
Where the run trains on a GPU the staging buffers are page-locked and the copies between them and the
GPU do not wait (``non_blocking``): a copy to the device is queued on the stream and the buffer is not
reused until a CUDA event recorded after it has passed; a copy from the device is waited for by the
I/O thread, before it writes the buffer, not by the training thread.  A pageable copy would stop the
training thread until the GPU has run everything queued before it, at every shard read or written.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Optional

import torch

from .preflight import preflight_nvme
from .swap_files import OffloadIOError, SwapFile, SwapSpace

if TYPE_CHECKING:
    from ..distributed.collectives import Collectives


class ParamSwap(SwapSpace):
    """One swap file per offloaded bucket shard, and the staging buffers that move them."""

    def __init__(self, shard_numels: dict[int, int], dtype: torch.dtype, nvme_path: str, config_key: str,
                 buffer_count: int, buffer_size: int, comm: "Collectives") -> None:
        size = torch.empty((), dtype=dtype).element_size()
        largest = max(shard_numels.values())
        if largest > buffer_size:
            raise ValueError(f"zero_optimization.offload_param.buffer_size is {buffer_size:,} elements but the "
                             f"shard of one stage-3 unit (or persistent bucket) has {largest:,}: raise "
                             f"buffer_size to at least that (a unit's size follows the model's blocks)")
        staging = min(buffer_size, largest)
        preflight_nvme(comm, nvme_path, config_key, sum(shard_numels.values()) * size, buffer_count * staging * size)
        super().__init__(nvme_path, comm.world.rank, "params")
        self.buffer_count = buffer_count
        # see [Note: staging buffers between a GPU and the swap files]
        pinned = comm.world.device_policy.pin_host_memory
        #: free staging buffers, each with the event after which no copy to the device reads it (or None)
        self._free: list[tuple[torch.Tensor, Optional[Any]]] = [
            (torch.empty(staging, dtype=dtype, pin_memory=pinned), None) for _ in range(buffer_count)]
        self._writes: deque[tuple[Future[None], torch.Tensor]] = deque()
        self.files: dict[int, SwapFile] = {i: self.file(f"b{i}.shard", n * size) for i, n in shard_numels.items()}

    def read_into(self, bucket: int, into: torch.Tensor) -> None:
        """Read bucket ``bucket``'s shard into ``into``; on failure fill zeros and record the error
        (the collective goes on: see [Note: swap failures stop every rank together] in
        offload/swap_files.py)."""
        try:
            if into.device.type == "cpu":
                self.io.read(self.files[bucket], into).result()
                return
            staging = self._take()
            copied = None
            try:
                self.io.read(self.files[bucket], staging[: into.numel()]).result()
                asynchronous = staging.is_pinned() and into.is_cuda
                into.copy_(staging[: into.numel()], non_blocking=asynchronous)
                if asynchronous:  # the buffer is reused once the copy has run
                    copied = torch.cuda.Event()
                    copied.record()
            finally:
                self._free.append((staging, copied))
        except OffloadIOError as err:
            self.record(err)
            into.zero_()

    def write(self, bucket: int, start: int, values: torch.Tensor) -> None:
        """Queue a write of ``values`` at element ``start`` of the shard, rounded to the shard dtype."""
        staging = self._take()[: values.numel()]
        ready = None
        if values.is_cuda and staging.is_pinned():  # the I/O thread waits for the copy, not this one
            staging.copy_(values, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            ready = copied.synchronize
        else:
            staging.copy_(values)
        self._writes.append((self.io.write(self.files[bucket], staging, start * staging.element_size(), ready),
                             staging))

    def _take(self) -> torch.Tensor:
        """A free staging buffer (bounded: waits for the oldest write), no copy to the device still reading it."""
        while not self._free:
            self._finish_oldest_write()
        staging, copied = self._free.pop()
        if copied is not None:
            copied.synchronize()
        return staging

    def _finish_oldest_write(self) -> None:
        future, staging = self._writes.popleft()
        try:
            self.wait(future)
        finally:
            self._free.append((staging._base if staging._base is not None else staging, None))

    def flush(self) -> None:
        """Wait for every write (a failure is recorded)."""
        while self._writes:
            self._finish_oldest_write()

    def close(self) -> None:
        self.flush()
        super().close()
