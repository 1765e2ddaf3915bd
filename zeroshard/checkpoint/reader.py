"""Read any slice of any parameter (or optimizer moment) of a checkpoint, whatever the layout it was
saved in (see [Note: chunks and resharding] in checkpoint/format.py).  No process group needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .client_state import CLIENT_STATE_FILE
from .format import EXTRA_FILE, CheckpointError, Manifest, SafetensorsFile, rank_file


def chunk_saver(bucket: dict[str, Any], chunk: int) -> int:
    """The rank whose file holds chunk ``chunk`` of a manifest's bucket entry: ``rank_base + chunk *
    rank_stride`` (a part of a job in parts starts at its first rank, [Note: a checkpoint of a job in
    parts] in checkpoint/job.py; experts' buckets are held by every ``ep_size``-th rank, [Note: experts
    in a checkpoint] in experts/checkpoint.py)."""
    return int(bucket.get("rank_base", 0)) + chunk * int(bucket.get("rank_stride", 1))


class CheckpointReader:
    """Random access to a checkpoint's tensors, one slice at a time."""

    def __init__(self, directory: str | Path, verify: bool = True,
                 validate: Optional[Callable[[Path, Any], None]] = None, rank: Optional[int] = None) -> None:
        """``validate(directory, manifest)``: a schema check run before the files are verified.
        ``rank``: the loading rank; a node-local checkpoint is then read from (and verified in) this
        node's files only (see [Note: node-local checkpoints] in checkpoint/save.py)."""
        self.directory = Path(directory)
        self.manifest = Manifest.read(self.directory)
        if validate is not None:
            validate(self.directory, self.manifest.data)
        storage = self.manifest.data.get("storage") or {}
        self._home = rank_file(0)
        self._home_rank = 0
        self._node_local = bool(storage.get("node_local"))
        only = None
        if storage.get("node_local") and rank is not None:
            per_node = int(storage["ranks_per_node"])
            node = rank // per_node
            only = {rank_file(r) for r in range(node * per_node, (node + 1) * per_node)}
            only |= {EXTRA_FILE, CLIENT_STATE_FILE}
            self._home, self._home_rank = rank_file(rank), rank
        elif rank is not None and rank_file(rank) in self.manifest.data["files"] and all(
                rank < b["num_chunks"] for b in self.manifest.buckets):
            self._home, self._home_rank = rank_file(rank), rank  # a chunk of every bucket, the same scalar state
        if verify:
            self.manifest.verify_files(only)
        self._place: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
        self._bucket: dict[int, dict[str, Any]] = {}
        for bucket in self.manifest.buckets:
            self._bucket[int(bucket["index"])] = bucket
            for slot in bucket["params"]:
                self._place[slot["name"]] = (bucket, slot)
        self._files: dict[str, SafetensorsFile] = {}

    def close(self) -> None:
        """Close every file this reader opened (a loaded checkpoint's files are not held afterwards:
        pruning or deleting them frees their disk space at once)."""
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def data(self) -> dict[str, Any]:
        return self.manifest.data

    def param_names(self) -> list[str]:
        return list(self._place)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._place[name][1]["shape"])

    def bucket_of(self, name: str) -> int:
        return int(self._place[name][0]["index"])

    def _open(self, file: str) -> SafetensorsFile:
        handle = self._files.get(file)
        if handle is None:
            handle = SafetensorsFile(self.directory / file)
            self._files[file] = handle
        return handle

    def _chunk_slice(self, key: str, bucket: int, file_rank: int, start: int, end: int) -> torch.Tensor:
        file = rank_file(file_rank)
        name = f"{key}.b{bucket}"
        handle = self._open(file)
        if name not in handle:
            raise CheckpointError(f"{self.directory / file}: has no tensor {name!r}")
        return handle.read_flat(name, start, end)

    def _pieces(self, name: str, start: int, end: Optional[int]) -> list[tuple[int, int, int, int]]:
        """Where elements ``[start, end)`` of parameter ``name`` were saved: (bucket, rank of the file,
        first, last) of each saved chunk that holds some of them, in order (a bucket's chunk ``c`` is in
        the file of :func:`chunk_saver`)."""
        if name not in self._place:
            raise CheckpointError(f"{self.directory}: has no parameter {name!r}")
        bucket, slot = self._place[name]
        end = slot["numel"] if end is None else end
        chunk_numel = bucket["chunk_numel"]
        pieces = []
        position = slot["offset"] + start
        stop = slot["offset"] + end
        while position < stop:
            chunk, inner = divmod(position, chunk_numel)
            take = min(stop - position, chunk_numel - inner)
            pieces.append((bucket["index"], chunk_saver(bucket, chunk), inner, inner + take))
            position += take
        return pieces

    def files_holding(self, name: str, start: int = 0, end: Optional[int] = None) -> set[str]:
        """The files :meth:`read` opens for these elements (what a load verifies before reading)."""
        return {rank_file(chunk) for _, chunk, _, _ in self._pieces(name, start, end)}

    def home_file(self) -> str:
        """The file the per-bucket scalar state and the optimizer's state names are read from."""
        return self._home

    def read(self, name: str, key: str = "param", start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Elements ``[start, end)`` of parameter ``name``'s flattened ``key`` (``param`` or
        ``optim.<state>``), as a 1D tensor assembled from the chunks that hold them."""
        pieces = [self._chunk_slice(key, bucket, chunk, lo, hi) for bucket, chunk, lo, hi in self._pieces(name, start, end)]
        if not pieces:
            return torch.empty(0, dtype=torch.float32)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def tensor(self, name: str, key: str = "param") -> torch.Tensor:
        """Parameter ``name``'s whole ``key``, in its shape."""
        return self.read(name, key).view(self.shape(name))

    def scalar_file(self, bucket: int) -> str:
        """The file a bucket's scalar optimizer state is read from: the home file when it holds a chunk
        of the bucket, else the file of the bucket's first chunk."""
        entry = self._bucket[bucket]
        savers = {chunk_saver(entry, c) for c in range(int(entry["num_chunks"]))}
        if self._node_local or self._home_rank in savers:
            return self._home
        return rank_file(chunk_saver(entry, 0))

    def scalar_state(self, bucket: int) -> dict[str, torch.Tensor]:
        """Per-bucket scalar optimizer state (such as Adam's ``step``) as its first chunk's rank saved it."""
        handle = self._open(self.scalar_file(bucket))
        prefix, suffix = "optim_scalar.", f".b{bucket}"
        return {k[len(prefix):-len(suffix)]: handle.get_tensor(k) for k in handle.keys()
                if k.startswith(prefix) and k.endswith(suffix)}

    def holds(self, name: str, key: str) -> bool:
        """Whether ``key`` (``optim.<state>``) was saved for parameter ``name``'s bucket."""
        bucket, _ = self._place[name]
        index = int(bucket["index"])
        return f"{key}.b{index}" in self._open(self.scalar_file(index))

    def optimizer_state_keys(self) -> list[str]:
        """Names of the chunk-shaped optimizer states saved (``exp_avg``, ``exp_avg_sq``, ...)."""
        handle = self._open(self._home)
        return sorted({k.split(".")[1] for k in handle.keys() if k.startswith("optim.")})

    def rank_tensor(self, rank: int, name: str) -> Optional[torch.Tensor]:
        handle = self._open(rank_file(rank))
        return handle.get_tensor(name) if name in handle else None

    def client_tensor(self, name: str) -> torch.Tensor:
        """One tensor of the client state ([Note: client state holds tensors, never pickles] in
        checkpoint/client_state.py)."""
        if CLIENT_STATE_FILE not in self.manifest.data["files"]:
            raise CheckpointError(f"{self.directory}: the client state names tensor {name!r} but the manifest lists "
                                  f"no {CLIENT_STATE_FILE}")
        handle = self._open(CLIENT_STATE_FILE)
        if name not in handle:
            raise CheckpointError(f"{self.directory / CLIENT_STATE_FILE}: no tensor {name!r}, which the client "
                                  f"state names")
        return handle.get_tensor(name)

    def extra_files(self) -> list[str]:
        """The files of frozen parameters and module buffers (one per part of a job in parts)."""
        return [f for f in self.manifest.data.get("extra_files", [EXTRA_FILE]) if f in self.manifest.data["files"]]

    def extra(self) -> dict[str, torch.Tensor]:
        """Frozen parameters and module buffers, by state-dict name."""
        out: dict[str, torch.Tensor] = {}
        for file in self.extra_files():
            handle = self._open(file)
            out.update({k: handle.get_tensor(k) for k in handle.keys()})
        return out
