"""The on-disk format of a zeroshard checkpoint: versioned data, not pickled objects.

A checkpoint is a directory ``<save_dir>/<tag>/`` holding

- ``manifest.json``: format version, zeroshard version, world size, stage, dtype, the bucket layout
  (every parameter's name, shape and place), the optimizer's class and hyperparameters, the engine's
  counters, the LR schedule, the data-loader position, the client state, and every file's byte size
  and checksum;
- ``rank00000.safetensors`` ...: what each rank owned when it saved: its chunk of every bucket
  (``param.b<k>``), the optimizer state of those chunks (``optim.<key>.b<k>``), and its RNG state;
- ``model_extra.safetensors``: frozen parameters and module buffers (written by rank 0).

``<save_dir>/latest`` names the newest complete tag; it is replaced atomically, last.

[Note: chunks and resharding]
The manifest records, per bucket, its padded size, its chunk size and how many chunks it was cut into
(N at stages 1-3; 1 at stage 0, where rank 0 writes the whole bucket).  Element ``e`` of a parameter at
offset ``o`` in bucket ``k`` therefore lives in chunk ``(o + e) // chunk`` (the file of that rank) at
position ``(o + e) % chunk``.  That is all a reader needs to fetch any slice of any parameter or
moment, which is how a checkpoint is loaded at another world size or stage, and consolidated, without
ever holding more than a slice.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
import zlib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Optional

import torch

from .direct_io import DirectFile, aligned

FORMAT_NAME = "zeroshard-checkpoint"
#: 2: a file's checksum is its header's and its data's (``sha256_parts``), taken while it is written;
#: 3: the same parts' CRC-32 (``crc32_parts``), see [Note: checksums while writing]
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
LATEST = "latest"
EXTRA_FILE = "model_extra.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


class CheckpointDirectoryError(ValueError):
    """``save_checkpoint`` / ``load_checkpoint`` given no directory (None or an empty name)."""


def checked_directory(directory: Any, call: str, argument: str) -> Path:
    """``directory`` as a path, or :class:`CheckpointDirectoryError`: an empty name would otherwise mean
    the current directory, and None fails deep inside ``os.path``."""
    if directory is None or not str(directory).strip():
        raise CheckpointDirectoryError(f"{call}({argument}={directory!r}): name the checkpoint directory "
                                       f"(a path; use \".\" for the current directory)")
    return Path(directory)


def replaced_dir(root: Path, tag: str) -> Path:
    """Where a re-saved tag's previous checkpoint waits while the new one is moved into place."""
    return root / f".{tag}.replaced"


def published_dir(root: Path, tag: str) -> Path:
    """The complete checkpoint for ``tag``: ``root/tag``, or, if a re-save of that tag was cut off
    between moving the old one aside and moving the new one in, the old one where it waits."""
    directory = root / tag
    if not directory.exists() and replaced_dir(root, tag).is_dir():
        return replaced_dir(root, tag)
    return directory


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


class Checksum(str, Enum):
    """The checksums a manifest may record for a file (the value names its manifest entry)."""

    SHA256 = "sha256"  # formats 1 and 2
    CRC32 = "crc32"  # format 3


#: what a save records for each file (a load verifies whichever its manifest names)
CHECKSUM = Checksum.CRC32


class _Digest:
    """A running :class:`Checksum` of the bytes given to :meth:`update`."""

    def __init__(self, algorithm: Checksum) -> None:
        self._sha = hashlib.sha256() if algorithm is Checksum.SHA256 else None
        self._crc = 0

    def update(self, block: Any) -> None:
        if self._sha is not None:
            self._sha.update(block)
        else:
            self._crc = zlib.crc32(block, self._crc)  # lets go of the GIL on blocks over a few KiB

    def hexdigest(self) -> str:
        return self._sha.hexdigest() if self._sha is not None else f"{self._crc:08x}"


def _digests_around(path: Path, split: int, algorithm: Checksum, chunk: int = 1 << 22) -> tuple[str, str]:
    """The checksums of the file's first ``split`` bytes and of the rest (0: the rest is the whole file)."""
    head, body = _Digest(algorithm), _Digest(algorithm)
    with open(path, "rb") as f:
        head.update(f.read(split))
        while block := f.read(chunk):
            body.update(block)
    return head.hexdigest(), body.hexdigest()


def file_matches(path: Path, meta: dict[str, Any]) -> bool:
    """Whether ``path`` has the checksum its manifest entry records: the whole file's SHA-256 (format
    1), or its header's and its data's, SHA-256 (format 2) or CRC-32 (format 3; [Note: checksums while
    writing])."""
    if "sha256" in meta:
        return _digests_around(path, 0, Checksum.SHA256)[1] == meta["sha256"]
    algorithm = Checksum.CRC32 if "crc32_parts" in meta else Checksum.SHA256
    parts = meta[f"{algorithm.value}_parts"]
    return _digests_around(path, int(parts["split"]), algorithm) == (parts["head"], parts["body"])


class BackgroundChecksum:
    """The :data:`CHECKSUM` of the bytes handed to :meth:`update`, computed on a thread of its own
    while the caller writes them: a checkpoint file is checksummed as it is written, not read back
    afterwards.  Each block must stay unchanged until :meth:`hexdigest`."""

    def __init__(self) -> None:
        self._digest = _Digest(CHECKSUM)
        # at most two blocks waiting: a block may be a tensor read for the save (offloaded state), held
        # until checksummed, so the writer waits rather than let them pile up
        self._blocks: "queue.Queue[Optional[memoryview]]" = queue.Queue(maxsize=2)
        self._thread = threading.Thread(target=self._run, name="zeroshard-checksum", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (block := self._blocks.get()) is not None:
            self._digest.update(block)

    def update(self, block: memoryview) -> None:
        self._blocks.put(block)

    def hexdigest(self) -> str:
        """Wait for every block, then the checksum; the thread ends."""
        self.close()
        return self._digest.hexdigest()

    def close(self) -> None:
        if self._thread.is_alive():
            self._blocks.put(None)
            self._thread.join()


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON, atomically (:func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(data, indent=1))


def resolve_tag(root: Path, tag: Optional[str]) -> str:
    """The tag to read under ``root``: ``tag`` itself, or the one ``root/latest`` names."""
    if tag is not None:
        return tag
    latest = root / LATEST
    if not latest.is_file():
        raise CheckpointError(f"{latest}: missing; pass tag= or point load_dir at a directory saved with "
                              f"save_latest=True")
    return latest.read_text().strip()


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` of a checkpoint."""

    data: dict[str, Any]
    directory: Path

    @staticmethod
    def read(directory: Path) -> "Manifest":
        path = directory / MANIFEST
        if not path.is_file():
            raise CheckpointError(f"{path}: no manifest; this is not a complete zeroshard checkpoint")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: the manifest is not valid JSON ({err})") from None
        except OSError as err:
            raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{path}: not a zeroshard checkpoint manifest")
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise CheckpointError(f"{path}: entry 'format_version' is {version!r}, not a positive integer")
        if version > FORMAT_VERSION:
            raise CheckpointError(f"{path}: checkpoint format version {version} is newer than this zeroshard "
                                  f"understands ({FORMAT_VERSION}); upgrade zeroshard to load it")
        return Manifest(data, directory)

    @property
    def buckets(self) -> list[dict[str, Any]]:
        return list(self.data["buckets"])

    def verify_files(self, only: Optional[set[str]] = None) -> None:
        """Every listed file (of ``only``, where given) exists with its recorded size and checksum, or an
        error names it."""
        node_local = bool((self.data.get("storage") or {}).get("node_local"))
        for name, meta in self.data["files"].items():
            if only is not None and name not in only:
                continue
            path = self.directory / name
            if not path.is_file():
                hint = (" (a node-local checkpoint: each node holds its own ranks' files; copy every node's "
                        "files into one directory to read it whole)" if node_local else "")
                raise CheckpointError(f"{path}: missing (the checkpoint lists it){hint}")
            size = path.stat().st_size
            if size != meta["bytes"]:
                raise CheckpointError(f"{path}: {size} bytes, the manifest says {meta['bytes']} (truncated?)")
            if not file_matches(path, meta):
                raise CheckpointError(f"{path}: checksum mismatch (the file is corrupted)")


_DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
                torch.int8: "I8", torch.int16: "I16"}


def _entry_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def _header_json(header: dict[str, Any]) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


@dataclass(frozen=True)
class FileWriting:
    """How checkpoint files are written (``checkpoint.writer``): bytes per write call, or the bounce
    buffer's size for direct writes; whether around the page cache ([Note: writing checkpoints with
    O_DIRECT] in checkpoint/direct_io.py)."""

    io_chunk: int = 64 << 20
    direct: bool = False


class SafetensorsWriter:
    """Writes a safetensors file one tensor at a time, atomically; peak memory: the tensor being written.

    [Note: the header goes last]
    A safetensors file starts with a header that gives every tensor's offset, so a writer that does
    not know all its tensors up front (a rank file, read bucket by bucket) reserves room for the header,
    writes the tensors after it, and writes the header into the room at the end, padded with spaces
    (which the format allows: its own writer pads to 8 bytes the same way).  Should the header outgrow
    the room, the data is moved once behind a bigger one.  The file appears under its name only when
    complete (``os.replace`` after ``fsync``).  With ``direct`` the bytes go around the page cache
    (:mod:`.direct_io`), the room then ending on a block boundary.

    [Note: checksums while writing]
    A checkpoint records each file's checksum, which a load verifies.  Hashing the whole file means
    reading it back after writing (the header, which comes first, is known only at the end); instead
    the data's checksum is taken as each tensor is written (:class:`BackgroundChecksum`, beside the
    write) and the header's at the end, and the manifest records both with the offset where the data
    starts (``crc32_parts``).  A load reads the file once and checks both.

    The checksum is CRC-32 (format 3; files of formats 1 and 2 carry SHA-256, which a load still
    verifies).  It guards against files that were truncated, corrupted or mixed up, not against anyone
    forging one, and its CPU time falls on training: an asynchronous save checksums while the next
    steps run, and on a machine whose cores all run training that time is taken from them.  CRC-32
    takes less than half of SHA-256's CPU time (measured in benchmarks/RESULTS.md, section
    "Asynchronous checkpoint saves", paragraph "CRC-32 against SHA-256").
    """

    def __init__(self, path: Path, header_room: int = 1 << 16, writing: FileWriting = FileWriting(),
                 checksum: bool = False, pace: Optional[Callable[[int], None]] = None) -> None:
        """``checksum``: record the file's checksum for a manifest (:attr:`checksum`).  ``pace``: called
        with the size of each write call's bytes before they are written, and may block (an asynchronous
        save spread over steps, :mod:`.pacing`)."""
        self.path = path
        self._pace = pace
        self._room = header_room + (-header_room % 8)  # the data section starts 8-byte aligned
        self._io_chunk = max(1, writing.io_chunk)
        self._tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        self._direct: Optional[DirectFile] = None
        if writing.direct:
            room = aligned(8 + self._room) - 8
            self._direct = DirectFile.open(self._tmp, self._io_chunk, start=8 + room)
            if self._direct is not None:
                self._room = room
        self._file: Optional[BinaryIO] = None
        if self._direct is None:
            self._file = open(self._tmp, "wb")
            self._file.seek(8 + self._room)
        self._header: dict[str, Any] = {}
        self._offset = 0
        self._body = BackgroundChecksum() if checksum else None
        #: after finish(): the file's checksum as a manifest records it (see the Note)
        self.checksum: dict[str, Any] = {}

    @property
    def direct(self) -> bool:
        """Whether the bytes go around the page cache (False where the file system refused)."""
        return self._direct is not None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (any device; written as it is, in its dtype and shape)."""
        if name in self._header:
            raise ValueError(f"{self.path}: tensor {name!r} written twice")
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        self._header[name] = {"dtype": _DTYPE_CODES[tensor.dtype], "shape": list(tensor.shape),
                              "data_offsets": [self._offset, self._offset + nbytes]}
        if nbytes:
            raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            if self._pace is None:
                self._append(raw)
            else:  # one write call's bytes at a time, each when the pace lets it go
                for start in range(0, nbytes, self._io_chunk):
                    piece = raw[start: start + self._io_chunk]
                    self._pace(len(piece))
                    self._append(piece)
        self._offset += nbytes

    def _append(self, raw: memoryview) -> None:
        if self._body is not None:
            self._body.update(raw)  # the tensor is kept alive by the view until the digest is taken
        if self._direct is not None:
            self._direct.append(raw)
        else:
            assert self._file is not None
            for start in range(0, len(raw), self._io_chunk):
                self._file.write(raw[start: start + self._io_chunk])

    def finish(self) -> int:
        """Write the header, make the file durable and give it its name; returns its size in bytes."""
        raw = _header_json(self._header)
        size = 8 + self._room + self._offset
        body = self._body.hexdigest() if self._body is not None else None
        if self._direct is not None:
            if len(raw) <= self._room:
                head = struct.pack("<Q", self._room) + raw + b" " * (self._room - len(raw))
                self._direct.write_at(0, head)
                self._direct.close(size)
                self._record(head, body)
                os.replace(self._tmp, self.path)
                return size
            self._direct.close(size, durable=False)  # the rare outgrown header: on, as a buffered file
            self._direct = None
            self._file = open(self._tmp, "r+b")
        assert self._file is not None
        if len(raw) > self._room:
            self._move_data(len(raw) + (-len(raw) % 8))
        head = struct.pack("<Q", self._room) + raw + b" " * (self._room - len(raw))
        self._file.seek(0)
        self._file.write(head)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._record(head, body)
        os.replace(self._tmp, self.path)
        return 8 + self._room + self._offset

    def _record(self, head: bytes, body: Optional[str]) -> None:
        if body is None:
            return
        head_digest = _Digest(CHECKSUM)
        head_digest.update(head)
        self.checksum = {f"{CHECKSUM.value}_parts": {"split": len(head), "head": head_digest.hexdigest(),
                                                     "body": body}}

    def abort(self) -> None:
        """Close and remove the unfinished file."""
        if self._body is not None:
            self._body.close()
        if self._direct is not None:
            self._direct.discard()
        if self._file is not None:
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def _move_data(self, room: int) -> None:
        """Shift the data written so far behind a header room of ``room`` bytes (the rare case where
        the header outgrew the reserved room)."""
        assert self._file is not None
        self._file.flush()
        bigger = self._tmp.with_name(self._tmp.name + ".grow")
        with open(self._tmp, "rb") as old, open(bigger, "wb") as new:
            old.seek(8 + self._room)
            new.seek(8 + room)
            while block := old.read(self._io_chunk):
                new.write(block)
        self._file.close()
        os.replace(bigger, self._tmp)
        self._file = open(self._tmp, "r+b")
        self._room = room


def write_safetensors_streaming(path: Path, entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                                produce: Callable[[str], torch.Tensor]) -> None:
    """Write a safetensors file one tensor at a time (peak memory: one tensor).

    ``entries`` gives each tensor's name, shape and dtype up front (so the header's room is exact);
    ``produce(name)`` returns the tensor's values when its turn comes.
    """
    entries = list(entries)
    header, offset = {}, 0
    for name, shape, dtype in entries:
        nbytes = _entry_bytes(shape, dtype)
        header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    writer = SafetensorsWriter(path, header_room=len(_header_json(header)))
    try:
        for name, shape, dtype in entries:
            tensor = produce(name).detach().to("cpu").to(dtype)
            if tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"{name}: produced shape {tuple(tensor.shape)}, announced {tuple(shape)}")
            writer.add(name, tensor)
        writer.finish()
    except BaseException:
        writer.abort()
        raise


#: file suffixes written as torch pickles (what DeepSpeed's and Hugging Face's ``pytorch_model.bin`` are)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def write_state_dict(path: Path, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Write a full state dict as the file name says: a torch pickle for ``.bin``/``.pt``/``.pth``,
    safetensors otherwise; floating-point tensors in ``dtype``, others as they are.  Atomic."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    if path.suffix not in PICKLE_SUFFIXES:
        entries = [(k, tuple(v.shape), dtype if v.is_floating_point() else v.dtype) for k, v in state.items()]
        write_safetensors_streaming(path, entries, lambda k: cast(state[k]))
        return
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save({k: cast(v).contiguous() for k, v in state.items()}, tmp)
    os.replace(tmp, path)


_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


class SafetensorsFile:
    """Reads slices of tensors from a safetensors file with plain ``pread`` calls.

    [Note: why not safe_open]
    safetensors' own reader memory-maps the file; every page a slice touches then stays resident in
    this process until the file is closed, so assembling a model from many shards would show (and, under
    memory limits, cost) the size of everything read.  Reading exactly the bytes of each slice keeps
    consolidation's footprint at the slices themselves.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: cannot be read as safetensors ({err})") from None
        header.pop("__metadata__", None)
        self._header = header
        self._data_start = 8 + size
        self._fd = os.open(path, os.O_RDONLY)

    def keys(self) -> list[str]:
        return list(self._header)

    def __contains__(self, name: str) -> bool:
        return name in self._header

    def _info(self, name: str) -> tuple[torch.dtype, list[int], int]:
        meta = self._header[name]
        return _CODE_DTYPES[meta["dtype"]], meta["shape"], self._data_start + meta["data_offsets"][0]

    def read_flat(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``name``."""
        dtype, _, base = self._info(name)
        size = torch.empty((), dtype=dtype).element_size()
        raw = os.pread(self._fd, (end - start) * size, base + start * size)
        if len(raw) != (end - start) * size:
            raise CheckpointError(f"{self.path}: ends inside tensor {name!r} (truncated?)")
        return torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)

    def get_tensor(self, name: str) -> torch.Tensor:
        dtype, shape, _ = self._info(name)
        return self.read_flat(name, 0, int(torch.Size(shape).numel())).view(shape)

    def close(self) -> None:
        os.close(self._fd)
