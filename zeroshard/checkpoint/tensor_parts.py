"""Reading a tensor-parallel job's checkpoint at another tensor-parallel size: the parts joined by name.

[Note: a tensor-parallel checkpoint read at another size]
A job whose layers zeroshard split over T ranks (``tensor_parallel.autotp_size``) saves each
tensor-parallel rank's share as a checkpoint of its own (``mp_rank_XX/``, each readable at any
data-parallel size and ZeRO stage) and, beside them, ``tensor_split.json``: T and, for every split
parameter, the dimension it is split along.  Read at another size T' (1 for the plain model and for
``zeroshard consolidate``), each parameter's whole tensor (and each optimizer moment's) is joined from
the T parts along that dimension, and a rank takes its T'-th share along the dimension its own split
uses; a parameter kept whole reads part 0's copy.  Only what a load asks for is joined, one parameter
and key at a time.  Counters, schedule, loss scale and the random generators come from part 0, as
every part saved the same ones.  Every file of every part is verified before anything is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from .format import CheckpointError, published_dir, resolve_tag
from .reader import CheckpointReader

TENSOR_SPLIT_FILE = "tensor_split.json"


def part_directory(tensor_rank: int) -> str:
    """The directory of a tensor-parallel rank's part inside a checkpoint directory."""
    return f"mp_rank_{tensor_rank:02d}"


def write_tensor_split(save_dir: Path, size: int, dims: dict[str, int]) -> None:
    """Record, beside the parts, how the job splits its parameters (atomically)."""
    save_dir.mkdir(parents=True, exist_ok=True)
    staging = save_dir / f".{TENSOR_SPLIT_FILE}.tmp"
    staging.write_text(json.dumps({"size": size, "dims": dims}, indent=1, sort_keys=True))
    staging.replace(save_dir / TENSOR_SPLIT_FILE)


def is_tensor_parallel_job(directory: Path) -> bool:
    return (directory / TENSOR_SPLIT_FILE).is_file()


class _Verified:
    """Every part was verified whole when it was opened."""

    def verify_files(self, files: Any = None) -> None:
        return None


class TensorPartsReader:
    """The ``CheckpointReader`` interface over a tensor-parallel job's parts, at size ``size`` (this
    rank's share ``rank``; ``dims``: the dimension each of its split parameters is split along)."""

    def __init__(self, directory: Path, tag: Optional[str], rank: int = 0, size: int = 1,
                 dims: Optional[dict[str, int]] = None) -> None:
        """``directory``: a tensor-parallel job's (its parts beside ``tensor_split.json``), or one
        checkpoint saved without tensor parallelism (one part, nothing split)."""
        self.rank, self.size, self.dims = rank, size, dict(dims or {})
        if is_tensor_parallel_job(directory):
            split = json.loads((directory / TENSOR_SPLIT_FILE).read_text())
            self.saved_size: int = int(split["size"])
            self.saved_dims: dict[str, int] = {k: int(v) for k, v in split["dims"].items()}
            roots = [directory / part_directory(part) for part in range(self.saved_size)]
        else:
            self.saved_size, self.saved_dims, roots = 1, {}, [directory]
        tag = resolve_tag(roots[0], tag)
        self.readers: list[CheckpointReader] = []
        try:
            for root in roots:
                if not root.is_dir():
                    raise CheckpointError(f"{directory}: tensor-parallel part {root.name} is missing (the job was "
                                          f"saved at tensor-parallel size {self.saved_size})")
                self.readers.append(CheckpointReader(published_dir(root, tag)))
        except BaseException:
            self.close()
            raise
        self.directory = self.readers[0].directory
        self.manifest = _Verified()
        self._joined: Optional[tuple[tuple[str, str], torch.Tensor]] = None

    # ------------------------------------------------------------------ what is the same in every part
    @property
    def data(self) -> dict[str, Any]:
        return self.readers[0].data

    def param_names(self) -> list[str]:
        return self.readers[0].param_names()

    def bucket_of(self, name: str) -> int:
        return self.readers[0].bucket_of(name)

    def scalar_state(self, bucket: int) -> dict[str, torch.Tensor]:
        return self.readers[0].scalar_state(bucket)

    def scalar_file(self, bucket: int) -> str:
        return self.readers[0].scalar_file(bucket)

    def home_file(self) -> str:
        return self.readers[0].home_file()

    def holds(self, name: str, key: str) -> bool:
        return self.readers[0].holds(name, key)

    def optimizer_state_keys(self) -> list[str]:
        return self.readers[0].optimizer_state_keys()

    def rank_tensor(self, rank: int, name: str) -> Optional[torch.Tensor]:
        return self.readers[0].rank_tensor(rank, name)

    def extra_files(self) -> list[str]:
        return self.readers[0].extra_files()

    def client_tensor(self, name: str) -> torch.Tensor:
        return self.readers[0].client_tensor(name)

    def files_holding(self, name: str, start: int = 0, end: Optional[int] = None) -> set[str]:
        return set()  # every part's files were verified at opening

    # ------------------------------------------------------------------ joined and re-split
    def _whole(self, name: str, key: str) -> torch.Tensor:
        if self._joined is not None and self._joined[0] == (name, key):
            return self._joined[1]
        dim = self.saved_dims.get(name)
        whole = self.readers[0].tensor(name, key) if dim is None else \
            torch.cat([reader.tensor(name, key) for reader in self.readers], dim=dim)
        self._joined = ((name, key), whole)
        return whole

    def _mine(self, whole: torch.Tensor, name: str) -> torch.Tensor:
        dim = self.dims.get(name)
        return whole if dim is None or self.size == 1 else whole.chunk(self.size, dim)[self.rank].contiguous()

    def shape(self, name: str) -> tuple[int, ...]:
        shape = list(self.readers[0].shape(name))
        saved = self.saved_dims.get(name)
        if saved is not None:
            shape[saved] *= self.saved_size
        now = self.dims.get(name)
        if now is not None:
            shape[now] //= self.size
        return tuple(shape)

    def read(self, name: str, key: str = "param", start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        return self._mine(self._whole(name, key), name).reshape(-1)[start:end]

    def tensor(self, name: str, key: str = "param") -> torch.Tensor:
        return self._mine(self._whole(name, key), name)

    def extra(self) -> dict[str, torch.Tensor]:
        extras = [reader.extra() for reader in self.readers]
        out = {}
        for name, value in extras[0].items():
            dim = self.saved_dims.get(name)
            whole = value if dim is None else torch.cat([e[name] for e in extras], dim=dim)
            out[name] = self._mine(whole, name)
        return out

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def __enter__(self) -> "TensorPartsReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
