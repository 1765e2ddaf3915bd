"""Swap files: one tensor (or one piece of one) per file, read and written by a background thread.

[Note: swap files]
Each swapped tensor has its own file whose size is exactly the tensor's bytes, for any size (no block
padding: plain buffered ``pread``/``pwrite``, which need no alignment; the page cache is the disk's
business).  Reads and writes go through one I/O thread in submission order, so a read queued after a
write of the same file always sees the written bytes, and the training thread computes while the
thread moves data: double buffering without locks.  Every failure (a file removed under us, a short
read, a full disk) becomes an :class:`OffloadIOError` naming the file, raised in the training thread
when the result is waited for; a swap never continues with partial data.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import torch


class OffloadIOError(RuntimeError):
    """A swap file could not be read or written."""


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (a contiguous CPU tensor).

    Through ctypes rather than ``.numpy()``: a NumPy view would mark the tensor's storage as not
    resizable, and stage 3 reads shards straight into buffers whose storage it shrinks on release.
    """
    assert tensor.device.type == "cpu" and tensor.is_contiguous(), "swap I/O needs a contiguous host tensor"
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class SwapFile:
    """A file holding exactly ``nbytes`` bytes: one swapped tensor."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes
        self.written = False

    def write(self, tensor: torch.Tensor, offset: int = 0) -> None:
        """Write ``tensor``'s bytes at byte ``offset`` (the whole file when offset is 0 and sizes match)."""
        data = _bytes_of(tensor)
        if offset + len(data) > self.nbytes:
            raise OffloadIOError(f"{self.path}: writing {len(data)} bytes at {offset} overruns its {self.nbytes}")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                done = 0
                while done < len(data):
                    done += os.pwrite(fd, data[done:], offset + done)
                if not self.written:
                    os.ftruncate(fd, self.nbytes)  # the file's size is the tensor's size from the start
            finally:
                os.close(fd)
        except OSError as err:
            hint = " (the disk is full: free space under nvme_path or point it elsewhere)" \
                if err.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            raise OffloadIOError(f"writing swap file {self.path} ({len(data)} bytes at offset {offset}) failed: "
                                 f"{err.strerror}{hint}") from None
        self.written = True

    def read_into(self, tensor: torch.Tensor, offset: int = 0) -> None:
        """Fill ``tensor`` from byte ``offset``; a missing or short file is an error, never zeros."""
        data = _bytes_of(tensor)
        try:
            size = os.stat(self.path).st_size
            if size != self.nbytes:
                raise OffloadIOError(f"swap file {self.path} has {size} bytes, expected {self.nbytes}: it was "
                                     f"truncated or replaced while training")
            fd = os.open(self.path, os.O_RDONLY)
            try:
                done = 0
                while done < len(data):
                    got = os.preadv(fd, [data[done:]], offset + done)
                    if got == 0:
                        raise OffloadIOError(f"swap file {self.path}: unexpected end of file at byte {offset + done}")
                    done += got
            finally:
                os.close(fd)
        except FileNotFoundError:
            raise OffloadIOError(f"swap file {self.path} is missing: it was removed while training (zeroshard "
                                 f"keeps optimizer state or parameters there)") from None
        except OSError as err:
            raise OffloadIOError(f"reading swap file {self.path} failed: {err.strerror}") from None


class SwapDirectory:
    """A directory of this run's swap files under ``nvme_path``, removed when the run ends."""

    def __init__(self, nvme_path: str, rank: int, what: str) -> None:
        self.root = Path(nvme_path) / f"zeroshard_{what}_rank{rank}_{uuid.uuid4().hex[:8]}"
        self.root.mkdir(parents=True)

    def file(self, name: str, nbytes: int) -> SwapFile:
        return SwapFile(self.root / name, nbytes)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)



class SwapIO:
    """One background I/O thread; results (and errors) come back through futures."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeroshard-swap")
        self.seconds_reading = 0.0
        self.seconds_writing = 0.0
        self.bytes_read = 0
        self.bytes_written = 0

    def submit(self, fn: Callable[[], None]) -> "Future[None]":
        return self._pool.submit(fn)

    def read(self, file: SwapFile, into: torch.Tensor, offset: int = 0) -> "Future[None]":
        return self._timed(lambda: file.read_into(into, offset), into, writing=False)

    def write(self, file: SwapFile, tensor: torch.Tensor, offset: int = 0,
              ready: Optional[Callable[[], None]] = None) -> "Future[None]":
        """Queue a write of ``tensor``; ``ready``: waited for on the thread first (a copy into
        ``tensor`` still running on a GPU stream)."""
        return self._timed(lambda: file.write(tensor, offset), tensor, writing=True, ready=ready)

    def _timed(self, io: Callable[[], None], tensor: torch.Tensor, writing: bool,
               ready: Optional[Callable[[], None]] = None) -> "Future[None]":
        """Queue ``io`` on the thread, adding its seconds and bytes to the throughput counters."""
        def run() -> None:
            if ready is not None:
                ready()
            started = time.perf_counter()
            io()
            seconds, nbytes = time.perf_counter() - started, tensor.numel() * tensor.element_size()
            if writing:
                self.seconds_writing += seconds
                self.bytes_written += nbytes
            else:
                self.seconds_reading += seconds
                self.bytes_read += nbytes
        return self._pool.submit(run)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


class SwapSpace:
    """A swap directory with its I/O thread, its first failure, and its removal: what every kind of
    swapped state (optimizer masters and state, stage-3 parameter shards) shares.

    [Note: swap failures stop every rank together]
    A read or write that fails on one rank must not stop that rank alone (the others would wait in
    the next collective): the failure is kept (:meth:`record`) while the rank goes on issuing its
    collectives, and the engine raises it on every rank at once (:meth:`take_failure`).
    """

    def __init__(self, nvme_path: str, rank: int, what: str) -> None:
        self.directory = SwapDirectory(nvme_path, rank, what)
        self.io = SwapIO()
        self.failure: Optional[OffloadIOError] = None
        # this run's scratch space: removed when its owner goes, is closed, or the process exits
        self._finalizer = weakref.finalize(self, _remove, self.io, self.directory)

    def file(self, name: str, nbytes: int) -> SwapFile:
        return self.directory.file(name, nbytes)

    def wait(self, future: "Optional[Future[None]]") -> None:
        """Wait for ``future``; a swap error is recorded, not raised (see the Note)."""
        if future is None:
            return
        try:
            future.result()
        except OffloadIOError as err:
            self.record(err)

    def record(self, err: OffloadIOError) -> None:
        self.failure = self.failure or err

    def take_failure(self) -> Optional[OffloadIOError]:
        failure, self.failure = self.failure, None
        return failure

    def close(self) -> None:
        """Stop the I/O thread and remove the files (idempotent)."""
        self._finalizer()


def _remove(io: SwapIO, directory: SwapDirectory) -> None:
    io.shutdown()
    directory.remove()
