"""Pretrained weights straight into the shards: each rank reads only the byte ranges it keeps.

    with zeroshard.Init(config=ds_config):                 # built sharded, nothing whole on any rank
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(local_dir))
    zeroshard.load_pretrained(model, local_dir)           # before or after initialize()

[Note: reading only one's own slices]
The users' commonest complaint with ZeRO-3 and FSDP is running out of host memory while loading a
pretrained model: every rank (or rank 0, which then broadcasts) reads the whole checkpoint.  A
safetensors file says where every tensor's bytes are (a JSON header of dtypes, shapes and offsets), so
a rank can read exactly the elements of its own chunks with positioned reads (``os.pread``), one
piece at a time: no tensor is materialised whole except the small ones that every rank keeps whole
(norms, biases, persistent buckets), and nothing is memory-mapped (mapped pages count in the RSS of
every rank that touches them).  Its peak host memory is about its shard plus the largest piece it
reads.  Parameters built under ``zeroshard.Init`` keep their own slice of each flat parameter; after
``initialize()`` the engine's buckets say which elements each rank owns (at stages 0-2 the owned chunk
is read, then gathered as after an optimizer step).  A single ``model.safetensors`` or a sharded
checkpoint with ``model.safetensors.index.json`` both work; names follow the model's state dict (a tied
weight may be saved under any one of its names).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from ..sharding.stage3.init_param import InitShardedParameter
from ..sharding.storage import HOMES
from .background import wait_for_copies
from .interface import LiveEngine

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class PretrainedError(ValueError):
    """The directory is not a safetensors checkpoint of this model; the message names the file."""


@dataclass(frozen=True)
class _Entry:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the tensor's first element in the file

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


class SafetensorsIndex:
    """Where each tensor of a (possibly sharded) safetensors checkpoint is, from the files' headers."""

    def __init__(self, directory: Union[str, Path]) -> None:
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if directory.suffix == ".safetensors" and directory.is_file():  # one file, named directly
            files = [directory]
        elif index.is_file():
            files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
        elif (directory / "model.safetensors").is_file():
            files = [directory / "model.safetensors"]
        else:
            raise PretrainedError(f"{directory}: no model.safetensors or model.safetensors.index.json (zeroshard "
                                  f"reads safetensors checkpoints; convert a .bin one with save_pretrained)")
        self.entries: dict[str, _Entry] = {}
        self._fds: dict[Path, int] = {}
        for path in files:
            with open(path, "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(size))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in _DTYPES:
                    raise PretrainedError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which zeroshard "
                                          f"does not read")
                self.entries[name] = _Entry(path, _DTYPES[info["dtype"]], tuple(info["shape"]),
                                            8 + size + info["data_offsets"][0])

    def read(self, name: str, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of tensor ``name``, flattened (one positioned read)."""
        entry = self.entries[name]
        hi = entry.numel if hi is None else hi
        itemsize = torch.empty((), dtype=entry.dtype).element_size()
        fd = self._fds.get(entry.path)
        if fd is None:
            fd = self._fds[entry.path] = os.open(entry.path, os.O_RDONLY)
        raw = bytearray(max(hi - lo, 0) * itemsize)
        view = memoryview(raw)
        done, offset = 0, entry.start + lo * itemsize
        while done < len(raw):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise PretrainedError(f"{entry.path}: truncated while reading {name!r}")
            done += n
        return torch.frombuffer(raw, dtype=entry.dtype) if raw else torch.empty(0, dtype=entry.dtype)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __enter__(self) -> "SafetensorsIndex":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _aliases(module: nn.Module) -> dict[int, list[str]]:
    """Every state-dict name of each parameter and buffer object (a tied weight has several)."""
    names: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    return names


def _saved_name(index: SafetensorsIndex, candidates: list[str], shape: tuple[int, ...]) -> str:
    for name in candidates:
        entry = index.entries.get(name)
        if entry is not None:
            if entry.shape != tuple(shape):
                raise PretrainedError(f"{entry.path}: {name!r} has shape {list(entry.shape)}, the model's is "
                                      f"{list(shape)}")
            return name
    raise PretrainedError(f"the checkpoint has no tensor for {' / '.join(candidates)}")


def load_pretrained(target: Union[LiveEngine, nn.Module], directory: Union[str, Path]) -> None:
    """Fill ``target``'s parameters and persistent buffers from the safetensors checkpoint in
    ``directory`` (or the ``.safetensors`` file it names), each rank reading only what it keeps (see
    [Note: reading only one's own slices]).

    ``target`` is an engine (every rank calls it: the owned chunks are published with collectives), or
    a model, e.g. one built under ``zeroshard.Init`` (no collective).  Every parameter must be in the
    checkpoint (a missing one raises :class:`PretrainedError` naming it, before anything changes);
    buffers it does not hold keep their values.
    """
    with SafetensorsIndex(directory) as index:
        if isinstance(target, nn.Module):
            _into_module(target, index)
        else:
            _into_engine(target, index)


def _into_module(model: nn.Module, index: SafetensorsIndex) -> None:
    aliases = _aliases(model)
    plan = [(t, _saved_name(index, aliases[id(t)], tuple(t.shape))) for t in _unique(model.parameters())]
    buffers = [(b, n) for b in _unique(model.buffers()) for n in aliases.get(id(b), [])[:1] if n in index.entries]
    with torch.no_grad():
        for param, name in plan:
            if isinstance(param, InitShardedParameter):  # this rank's slice of the flat parameter
                own = param._zeroshard_shard
                lo = param._zeroshard_comm.world.rank * own.numel()
                hi = min(lo + own.numel(), param.numel())
                own.zero_()
                if hi > lo:
                    own[: hi - lo].copy_(index.read(name, lo, hi))
            else:
                param.data.copy_(index.read(name).view(param.shape))
        for buffer, name in buffers:
            buffer.copy_(index.read(name).view(buffer.shape))


def _unique(tensors: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def _into_engine(engine: LiveEngine, index: SafetensorsIndex) -> None:
    wait_for_copies()  # see [Note: asynchronous saves] in checkpoint/background.py
    module = engine.module
    storage = engine.storage
    # each stored parameter (by its slot name) -> the name it has in the file, all checked first
    names_of_slot: dict[str, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        home = HOMES.home_of(tensor)
        if home is not None:
            names_of_slot.setdefault(home.name, []).append(name)
    saved = {slot.name: _saved_name(index, names_of_slot.get(slot.name, [slot.name]), slot.shape)
             for bucket in storage.layout.buckets for slot in bucket.slots}
    aliases = _aliases(module)
    whole = [(p, _saved_name(index, aliases[id(p)], tuple(p.shape))) for p in engine.frozen_params]
    buffers = [(b, n) for b in _unique(module.buffers()) for n in aliases.get(id(b), [])[:1] if n in index.entries]
    shards = engine.checkpoint_parts().shards
    rank = shards.rank
    with torch.no_grad():
        for bucket in storage.layout.buckets:
            if bucket.frozen:  # stage 3's frozen buckets: this rank's chunk, in the training dtype
                start, end = bucket.shard_range(rank)
                chunk = torch.zeros(end - start, dtype=storage.dtype)
                bucket.fill_chunk(start, chunk, lambda slot, lo, hi: index.read(saved[slot.name], lo, hi))
                storage.write_own_chunk(bucket.index, chunk)
                continue
            values, _, scalars = shards.read_bucket(bucket)  # the owned chunk (fp32 masters if any)
            staged = torch.zeros(values.numel(), dtype=values.dtype)
            bucket.fill_chunk(bucket.chunk_start(values.numel(), rank), staged,
                              lambda slot, lo, hi: index.read(saved[slot.name], lo, hi))
            shards.write_bucket(bucket, staged.to(values.device), None, scalars)
        for param, name in whole:
            param.data.copy_(index.read(name).view(param.shape))
        for buffer, name in buffers:
            buffer.copy_(index.read(name).view(buffer.shape))
        shards.publish()  # gathers what is kept whole (stages 0-2, persistent buckets)

