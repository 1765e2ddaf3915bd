"""Saving a checkpoint: every rank writes what it owns; rank 0 writes the manifest and flips ``latest``.

[Note: a save that is interrupted loses nothing]
All files go first into ``<save_dir>/.<tag>.incomplete/``.  Only when every rank has written and
checksummed its file does rank 0 write the manifest, move the directory to ``<save_dir>/<tag>`` and
then replace ``latest`` atomically.  A process killed at any point leaves the previous checkpoint and
``latest`` exactly as they were; the next save of the same tag clears the leftover directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..version import __version__
from .format import (replaced_dir, EXTRA_FILE, FORMAT_NAME, FORMAT_VERSION, LATEST, MANIFEST, CheckpointError, rank_file,
                     sha256_of, write_json_atomic, write_text_atomic)
from .interface import CheckpointParts


def barrier(parts: CheckpointParts, label: str) -> None:
    parts.comm.all_reduce_scalar(0.0, label)


def _json_or_error(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{what} cannot be saved: it is not JSON-serializable ({err})") from None
    return value


def rank_tensors(parts: CheckpointParts) -> dict[str, torch.Tensor]:
    """What this rank writes: its chunks (fp32 masters when there are any), their optimizer state
    (read back from host memory or NVMe where offloaded), and its RNG state."""
    out: dict[str, torch.Tensor] = dict(parts.rng.state_dict())
    shards = parts.shards
    for bucket, (_, chunks) in zip(shards.layout.buckets, shards.chunk_layout()):
        if shards.rank >= chunks or not shards.writes_chunks:
            continue  # stage 0: every rank holds the same bucket, rank 0 writes it; MiCS: the first group
        values, state, scalars = shards.read_bucket(bucket)
        out[f"param.b{bucket.index}"] = values.to("cpu")
        for key, value in scalars.items():
            out[f"optim_scalar.{key}.b{bucket.index}"] = value.to("cpu")
        for key, value in state.items():
            out[f"optim.{key}.b{bucket.index}"] = value.to("cpu").reshape(-1)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _manifest(parts: CheckpointParts, tag: str, client_state: Any, files: dict[str, Any],
              model: dict[str, Any]) -> dict[str, Any]:
    shards = parts.shards
    buckets = []
    for bucket, (chunk_numel, chunks) in zip(shards.layout.buckets, shards.chunk_layout()):
        buckets.append({
            "index": bucket.index, "group": bucket.group_index, "numel": bucket.numel,
            "padded_numel": bucket.padded_numel, "chunk_numel": chunk_numel, "num_chunks": chunks,
            "params": [{"name": s.name, "offset": s.offset, "numel": s.numel, "shape": list(s.shape)}
                       for s in bucket.slots],
        })
    scheduler = parts.lr_scheduler.state_dict() if parts.lr_scheduler is not None else None
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "zeroshard_version": __version__,
        "tag": tag, "world_size": parts.world.world_size, "stage": parts.stage,
        "dtype": _dtype_name(shards.saved_dtype),  # the saved chunks: fp32 masters under mixed precision
        "compute_dtype": _dtype_name(shards.compute_dtype),
        "buckets": buckets,
        "optimizer": {"class": parts.optimizer.class_name,
                      "param_groups": _json_or_error(parts.optimizer.state_dict(), "the optimizer's hyperparameters")},
        "lr_scheduler": _json_or_error(scheduler, "the LR scheduler's state"),
        "engine": {**parts.counters.state_dict(), "loss_scaler": parts.loss_scaler.state_dict()},
        "loader": parts.loader.state_dict() if parts.loader is not None else None,
        "client_state": _json_or_error(client_state, "client_state"),
        "model": {**model, "hf_config": _json_or_error(model["hf_config"], "the model's config"),
                  "peft_config": _json_or_error(model.get("peft_config"), "the peft adapter's config")},
        "files": files,
    }


def save_checkpoint(parts: CheckpointParts, save_dir: str | Path, tag: str, client_state: Any = None,
                    save_latest: bool = True, node_local: bool = False, exclude_frozen: bool = False) -> Path:
    """Write a checkpoint of ``parts`` under ``save_dir/tag``; every rank must call it.

    ``node_local`` (``checkpoint.use_node_local_storage``): ``save_dir`` is a directory of each node's
    own; see [Note: node-local checkpoints].
    """
    root = Path(save_dir)
    staging = root / f".{tag}.incomplete"
    rank = parts.world.rank
    leader = parts.world.local_rank == 0 if node_local else rank == 0  # who prepares and publishes
    if leader:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    barrier(parts, "checkpoint_start")
    mine = staging / rank_file(rank)
    save_file(rank_tensors(parts), str(mine))
    sidecar = {mine.name: {"bytes": mine.stat().st_size, "sha256": sha256_of(mine)}}
    model = parts.module.describe()
    # every rank: stage 3 gathers its frozen buckets; the leader writes them
    extra = parts.module.extra_tensors(set(model["trainable_of"]), keep=leader, exclude_frozen=exclude_frozen)
    if leader:
        if extra:
            save_file(extra, str(staging / EXTRA_FILE))
            sidecar[EXTRA_FILE] = {"bytes": (staging / EXTRA_FILE).stat().st_size,
                                   "sha256": sha256_of(staging / EXTRA_FILE)}
    final = root / tag
    if node_local:
        manifest = _node_local_manifest(parts, tag, client_state, sidecar, model)
        if leader:
            write_json_atomic(staging / MANIFEST, manifest)
            _publish(root, staging, tag, save_latest)
        barrier(parts, "checkpoint_done")
        return final
    write_json_atomic(staging / f"rank{rank:05d}.json", sidecar)
    barrier(parts, "checkpoint_written")
    if rank == 0:
        files: dict[str, Any] = {}
        for r in range(parts.world.world_size):
            part = staging / f"rank{r:05d}.json"
            files.update(json.loads(part.read_text()))
            part.unlink()
        write_json_atomic(staging / MANIFEST, _manifest(parts, tag, client_state, files, model))
        _publish(root, staging, tag, save_latest)
    barrier(parts, "checkpoint_done")
    return final


def _publish(root: Path, staging: Path, tag: str, save_latest: bool) -> None:
    """Move the complete ``staging`` directory to ``root/tag`` and name it in ``latest``."""
    final = root / tag
    old = replaced_dir(root, tag)
    if final.exists():  # re-saving a tag: the old one stays readable until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    staging.rename(final)
    if save_latest:
        write_text_atomic(root / LATEST, tag)
    shutil.rmtree(old, ignore_errors=True)


def _node_local_manifest(parts: CheckpointParts, tag: str, client_state: Any, sidecar: dict[str, Any],
                         model: dict[str, Any]) -> dict[str, Any]:
    """[Note: node-local checkpoints]
    With ``checkpoint.use_node_local_storage`` no directory is shared between nodes: every rank
    writes its file into its own node's ``save_dir``, each node's local rank 0 writes the frozen
    parameters and buffers there too, and the file sizes and checksums travel by collective instead
    of through the file system.  Rank 0 builds the manifest, which lists every rank's file, and each
    node's local rank 0 writes the same bytes and publishes the directory and ``latest`` on its node.
    A node then holds its own ranks' files: such a checkpoint loads with the same world size, ranks per
    node, stage and buckets (each rank reads only its own file); to reshard it, copy every node's
    files into one directory first.
    """
    files: dict[str, Any] = {}
    extras = set()
    for theirs in parts.comm.all_gather_json(sidecar, "checkpoint_files"):
        if EXTRA_FILE in theirs:
            extras.add(theirs[EXTRA_FILE]["sha256"])
        files.update({name: meta for name, meta in theirs.items() if name not in files})
    if len(extras) > 1:
        raise CheckpointError(f"{EXTRA_FILE} differs between nodes (frozen parameters or buffers that are not "
                              f"the same on every node); this checkpoint was not published")
    manifest = None
    if parts.world.rank == 0:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", parts.world.world_size))
        manifest = {**_manifest(parts, tag, client_state, files, model),
                    "storage": {"node_local": True, "ranks_per_node": ranks_per_node}}
    return parts.comm.broadcast_json(manifest, 0, "checkpoint_manifest")
