"""NVMe parameter offload: stage 3's shards that live in swap files, read for gathers, written after steps.

A gather reads a shard straight into the full buffer's own slot (through a staging buffer when the
device is a GPU); an update writes the rounded values back from a staging buffer.  ``buffer_count``
staging buffers of ``buffer_size`` elements bound the writes in flight.  Reads and writes share one
I/O thread in submission order, so a gather always reads the last update.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

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
        self._free = [torch.empty(staging, dtype=dtype) for _ in range(buffer_count)]
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
            while not self._free:
                self._finish_oldest_write()
            staging = self._free.pop()
            try:
                self.io.read(self.files[bucket], staging[: into.numel()]).result()
                into.copy_(staging[: into.numel()])
            finally:
                self._free.append(staging)
        except OffloadIOError as err:
            self.record(err)
            into.zero_()

    def write(self, bucket: int, start: int, values: torch.Tensor) -> None:
        """Queue a write of ``values`` at element ``start`` of the shard, rounded to the shard dtype."""
        while not self._free:  # bounded staging: wait for the oldest write
            self._finish_oldest_write()
        staging = self._free.pop()[: values.numel()]
        staging.copy_(values)
        self._writes.append((self.io.write(self.files[bucket], staging, start * staging.element_size()), staging))

    def _finish_oldest_write(self) -> None:
        future, staging = self._writes.popleft()
        try:
            self.wait(future)
        finally:
            self._free.append(staging._base if staging._base is not None else staging)

    def flush(self) -> None:
        """Wait for every write (a failure is recorded)."""
        while self._writes:
            self._finish_oldest_write()

    def close(self) -> None:
        self.flush()
        super().close()
