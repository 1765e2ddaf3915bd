"""Checkpoint files written around the page cache (``O_DIRECT``): ``checkpoint.writer.type: "fast"``.

[Note: writing checkpoints with O_DIRECT]
A buffered write copies every byte into the page cache, whose pages the kernel must first find (on a
virtual machine, often by faulting fresh memory in from the host) and later write back; a checkpoint is
written once and not read again soon, so that cache buys nothing, and a buffered write's time varies
several-fold where a direct one's stays steady (measured in benchmarks/RESULTS.md, section "Asynchronous
checkpoint saves", paragraph "The page-cache writer").  ``O_DIRECT`` wants the buffer, the file offset
and the length aligned to the device's block, so the bytes go through one page-aligned bounce buffer of
``io_buffer_size`` bytes (DeepSpeed's FastPersist writer works the same way); the file's last, partial
block is written padded with zeros and the file truncated to its true size.  Where the file system
refuses ``O_DIRECT`` (tmpfs, some network file systems), a probe write at open says so and the writer
falls back to buffered writes: the same file either way.

The copy into the bounce buffer is a ``memmove`` called through ctypes, which lets go of the GIL
while it copies: an asynchronous save writes on a thread of the training process, and a copy of
64 MiB done by Python (a memoryview slice assignment) holds the GIL for tens of milliseconds; at
the writer's low priority, on a machine whose cores all run training, the training thread then
waits for a thread the scheduler seldom runs.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from typing import Optional

#: alignment of buffers, offsets and lengths: the largest logical block size in common use
ALIGN = 4096


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        if written <= 0:
            raise OSError(errno.EIO, "short write")
        data, offset = data[written:], offset + written


class DirectFile:
    """Sequential ``O_DIRECT`` writes from ``start`` (aligned) through one aligned bounce buffer."""

    @staticmethod
    def open(path: os.PathLike | str, buffer_bytes: int, start: int) -> Optional["DirectFile"]:
        """The file created for direct writes, or None where the platform or file system has none."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
        except OSError as err:
            if err.errno == errno.EINVAL:
                return None
            raise
        direct = DirectFile(fd, buffer_bytes, start)
        try:  # some file systems accept the flag at open and refuse the writes
            _write_all(fd, direct._view[:ALIGN], 0)
        except OSError as err:
            direct.discard()
            if err.errno == errno.EINVAL:
                os.unlink(path)
                return None
            raise
        return direct

    def __init__(self, fd: int, buffer_bytes: int, start: int) -> None:
        assert start % ALIGN == 0
        self._fd = fd
        self._buffer = mmap.mmap(-1, max(ALIGN, buffer_bytes // ALIGN * ALIGN))  # page-aligned
        self._view = memoryview(self._buffer)
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._buffer))
        self._fill = 0
        self._position = start  # where the buffer's first byte goes

    def append(self, data: memoryview) -> None:
        """Write ``data`` after what was appended before (any length, any alignment)."""
        size = len(self._buffer)
        while data:
            n = min(len(data), size - self._fill)
            self._copy_in(self._fill, data[:n])
            self._fill += n
            data = data[n:]
            if self._fill == size:
                _write_all(self._fd, self._view, self._position)
                self._position += size
                self._fill = 0

    def _copy_in(self, at: int, data: memoryview) -> None:
        """Copy ``data`` into the buffer at ``at``, without the GIL where ``data`` is writable memory
        (a tensor's: see the Note); a read-only buffer is copied by Python."""
        try:
            source = ctypes.addressof(ctypes.c_char.from_buffer(data))
        except TypeError:
            self._view[at: at + len(data)] = data
            return
        ctypes.memmove(self._address + at, source, len(data))

    def _flush_tail(self) -> int:
        """Write the buffered rest padded to a block; returns the end of the real bytes."""
        end = self._position + self._fill
        if self._fill:
            padded = aligned(self._fill)
            self._view[self._fill: padded] = bytes(padded - self._fill)
            _write_all(self._fd, self._view[:padded], self._position)
        self._position, self._fill = end, 0
        return end

    def write_at(self, offset: int, data: bytes) -> None:
        """Write ``data`` (an aligned length) at ``offset`` (aligned): the header, at the end."""
        assert offset % ALIGN == 0 and len(data) % ALIGN == 0
        self._flush_tail()
        size = len(self._buffer)
        for start in range(0, len(data), size):
            piece = data[start: start + size]
            self._view[: len(piece)] = piece
            _write_all(self._fd, self._view[: len(piece)], offset + start)

    def close(self, size: int, durable: bool = True) -> None:
        """Write what is buffered, cut the file to ``size`` bytes, ``fsync`` it (with ``durable``), close."""
        self._flush_tail()
        try:
            os.ftruncate(self._fd, size)
            if durable:
                os.fsync(self._fd)
        finally:
            self.discard()

    def discard(self) -> None:
        """Close without writing what is buffered."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._view.release()
        try:
            self._buffer.close()
        except BufferError:  # a slice still held (by an exception's traceback): freed with it
            pass
