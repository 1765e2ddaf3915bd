"""``zeroshard convert``: a checkpoint DeepSpeed wrote, rewritten offline in zeroshard's format, and
back: any checkpoint in DeepSpeed's layout at a chosen world size and stage (writer.py).

[Note: a converted checkpoint is one rank's]
The converted checkpoint is the one a single rank at stage 0 would have saved: one bucket per
DeepSpeed parameter group, unpadded, in one rank file (fp32 masters, the Adam moments and the step),
the buffers in the extra file, and a manifest with DeepSpeed's counters, LR scheduler state, optimizer
hyperparameters and client state.  zeroshard's loader reshards any checkpoint to any world size and
stage, reading only each rank's share, so one rank's layout loses nothing; it needs no process group
and no model to write.  The client state must be JSON, as in every zeroshard checkpoint: the entries
of DeepSpeed's model file that are not (its ``param_shapes``, a client's tensors) are left out and
listed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from ...version import __version__
from ..format import (EXTRA_FILE, FORMAT_NAME, FORMAT_VERSION, LATEST, MANIFEST, CheckpointError, SafetensorsWriter,
                      rank_file, write_json_atomic, write_text_atomic)
from .partitions import MOMENTS
from .reader import DeepSpeedReader, deepspeed_directory
from .writer import write_deepspeed


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _write(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    writer = SafetensorsWriter(path, checksum=True)
    try:
        for name, tensor in tensors:
            writer.add(name, tensor.contiguous())
        size = writer.finish()
    except BaseException:
        writer.abort()
        raise
    return {"bytes": size, **writer.checksum}


def _buckets(reader: DeepSpeedReader) -> tuple[list[dict[str, Any]], list[tuple[str, torch.Tensor]]]:
    """One bucket per DeepSpeed group, its parameters end to end; the rank file's tensors."""
    groups: dict[int, list[str]] = {}
    for name in reader.param_names():
        groups.setdefault(reader.bucket_of(name), []).append(name)
    buckets, tensors = [], []
    for index, (group, names) in enumerate(sorted(groups.items())):
        slots, offset = [], 0
        for name in names:
            numel = reader.read(name).numel()
            slots.append({"name": name, "offset": offset, "numel": numel, "shape": list(reader.shape(name))})
            offset += numel
        buckets.append({"index": index, "group": group, "numel": offset, "padded_numel": offset,
                        "chunk_numel": offset, "num_chunks": 1, "params": slots})
        tensors.append((f"param.b{index}", torch.cat([reader.read(n) for n in names])))
        tensors += [(f"optim_scalar.{k}.b{index}", v) for k, v in reader.scalar_state(group).items()]
        tensors += [(f"optim.{m}.b{index}", torch.cat([reader.read(n, f"optim.{m}") for n in names]))
                    for m in MOMENTS]
    return buckets, tensors


def convert_deepspeed(checkpoint: str | Path, out: str | Path, tag: Optional[str] = None) -> tuple[Path, list[str]]:
    """Write the DeepSpeed checkpoint ``checkpoint`` (a save_dir with ``latest``, or ``tag`` under it)
    as a zeroshard checkpoint under ``out`` (its tag the same, ``latest`` naming it); see [Note: a
    converted checkpoint is one rank's].  Returns the directory written and the client-state entries
    left out because they are not JSON."""
    root = Path(checkpoint)
    directory = deepspeed_directory(root, tag)
    if directory is None and tag is None and deepspeed_directory(root.parent, root.name) is not None:
        directory = root  # the tag's directory itself
    if directory is None:
        raise CheckpointError(f"{root}: not a DeepSpeed checkpoint (no 'latest' naming a directory with "
                              f"mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt)")
    with DeepSpeedReader(directory) as reader:
        buckets, tensors = _buckets(reader)
        data = reader.data
        client = data["client_state"]
        left_out = sorted(k for k, v in client.items() if not _is_json(v))
        extra = reader.extra()
        final = Path(out) / directory.name
        staging = Path(out) / f".{directory.name}.incomplete"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        files = {rank_file(0): _write(staging / rank_file(0), tensors)}
        if extra:
            files[EXTRA_FILE] = _write(staging / EXTRA_FILE, list(extra.items()))
        manifest = {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "zeroshard_version": __version__,
            "tag": directory.name, "world_size": 1, "stage": 0, "dtype": "float32",
            "compute_dtype": data["dtype"], "buckets": buckets,
            "optimizer": {"class": str(((reader.model.get("ds_config") or {}).get("optimizer") or {}).get("type", "")),
                          "param_groups": data["optimizer"]["param_groups"]},
            "lr_scheduler": data["lr_scheduler"] if _is_json(data["lr_scheduler"]) else None,
            "engine": data["engine"], "loader": None,
            "client_state": {k: v for k, v in client.items() if k not in left_out},
            "model": reader.model_description(),
            "converted_from": {"format": "deepspeed", "ds_version": reader.model.get("ds_version"),
                               "world_size": reader.world_size, "stage": reader.stage},
            "files": files,
        }
        write_json_atomic(staging / MANIFEST, manifest)
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    write_text_atomic(Path(out) / LATEST, directory.name)
    return final, left_out


def open_any(checkpoint: str | Path, tag: Optional[str] = None) -> Any:
    """A reader of ``checkpoint``: DeepSpeed's layout (a save_dir, or one tag's directory) or zeroshard's."""
    root = Path(checkpoint)
    directory = deepspeed_directory(root, tag)
    if directory is None and tag is None and deepspeed_directory(root.parent, root.name) is not None:
        directory = root
    if directory is not None:
        return DeepSpeedReader(directory)
    from ..consolidate import open_reader
    return open_reader(root, tag)


def convert_to_deepspeed(checkpoint: str | Path, out: str | Path, world_size: int, stage: int,
                         dtype: Optional[str] = None, tag: Optional[str] = None) -> Path:
    """Write the checkpoint ``checkpoint`` (zeroshard's, or DeepSpeed's at any world size and stage) as
    the DeepSpeed checkpoint of a ``world_size``-rank job at ZeRO ``stage`` under ``out`` (the same tag,
    ``latest`` naming it); ``dtype`` ("fp32" or "bf16"; default: the checkpoint's training dtype).
    Returns the tag's directory."""
    with open_any(checkpoint, tag) as reader:
        data = reader.data
        trained_in = data.get("compute_dtype") or data.get("dtype")
        chosen = dtype or ("bf16" if trained_in == "bfloat16" else "fp32")
        if chosen not in ("fp32", "bf16"):
            raise CheckpointError(f"DeepSpeed's layout is written for fp32 or bf16 training, not {chosen}")
        name = getattr(reader, "directory", Path(checkpoint)).name
        # DeepSpeed's files record its clipping (its stages 1-2 take it from there); zeroshard's do not
        ds_config = (getattr(reader, "model", None) or {}).get("ds_config") or {}
        clip = ds_config.get("gradient_clipping")
        return write_deepspeed(reader, out, name, world_size, stage, torch.bfloat16 if chosen == "bf16" else torch.float32,
                               clip_grad=None if clip is None else float(clip))


def convert_to_universal(checkpoint: str | Path, out: str | Path, world_size: int = 1, stage: int = 2,
                         dtype: Optional[str] = None, tag: Optional[str] = None) -> Path:
    """Write the checkpoint ``checkpoint`` as DeepSpeed's universal folder ``out/<tag>`` (``latest_universal``
    naming it): a DeepSpeed ZeRO checkpoint directly, any other first in DeepSpeed's layout for
    ``world_size`` ranks at ``stage`` (whose model files the universal folder keeps).  Returns the folder."""
    from .universal import write_universal

    with open_any(checkpoint, tag) as reader:
        is_deepspeed = isinstance(reader, DeepSpeedReader) and reader.stage > 0
        name = getattr(reader, "directory", Path(checkpoint)).name
        source = reader.directory if is_deepspeed else None
    if source is not None:
        return write_universal(source, Path(out) / name)
    staging = Path(out) / f".{name}.deepspeed"
    try:
        written = convert_to_deepspeed(checkpoint, staging, world_size, stage, dtype, tag)
        return write_universal(written, Path(out) / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
