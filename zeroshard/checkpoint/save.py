"""Saving a checkpoint: every rank writes what it owns; rank 0 writes the manifest and flips ``latest``.

[Note: a save that is interrupted loses nothing]
All files go first into ``<save_dir>/.<tag>.incomplete/``.  Only when every rank has written and
checksummed its file does rank 0 write the manifest, move the directory to ``<save_dir>/<tag>`` and
then replace ``latest`` atomically.  A process killed at any point leaves the previous checkpoint and
``latest`` exactly as they were; the next save of the same tag clears the leftover directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from safetensors.torch import save_file

from ..sharding.storage import HOMES
from ..version import __version__
from .format import (replaced_dir, EXTRA_FILE, FORMAT_NAME, FORMAT_VERSION, LATEST, MANIFEST, CheckpointError, rank_file,
                     sha256_of, write_json_atomic, write_text_atomic)

if TYPE_CHECKING:
    from .interface import TrainingState


def barrier(engine: "TrainingState", label: str) -> None:
    engine.comm.all_reduce_scalar(0.0, label)


def _json_or_error(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{what} cannot be saved: it is not JSON-serializable ({err})") from None
    return value


def chunk_layout(engine: "TrainingState") -> list[tuple[int, int]]:
    """Per bucket: (chunk size, number of chunks) as this engine owns them (stage 0: one whole chunk)."""
    return [(engine.updater.owned_numel(bucket), bucket.padded_numel // engine.updater.owned_numel(bucket))
            for bucket in engine.flat.layout.buckets]


def rank_tensors(engine: "TrainingState") -> dict[str, torch.Tensor]:
    """What this rank writes: its chunks (fp32 masters when there are any), their optimizer state
    (read back from host memory or NVMe where offloaded), and its RNG state."""
    out: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["rng.cuda"] = torch.cuda.get_rng_state()
    for bucket, (_, chunks) in zip(engine.flat.layout.buckets, chunk_layout(engine)):
        if engine.world.rank >= chunks:
            continue  # stage 0: every rank holds the same bucket, rank 0 writes it
        values, state, scalars = engine.updater.read_bucket(bucket)
        out[f"param.b{bucket.index}"] = values.to("cpu")
        for key, value in scalars.items():
            out[f"optim_scalar.{key}.b{bucket.index}"] = value.to("cpu")
        for key, value in state.items():
            out[f"optim.{key}.b{bucket.index}"] = value.to("cpu").reshape(-1)
    return out


def _model_description(engine: "TrainingState") -> dict[str, Any]:
    """State-dict keys in order, which trainable parameter each key is (tied weights), the rest."""
    index_of = {id(p): i for i, p in enumerate(engine.strategy.params)}
    keys, trainable_of = [], {}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        keys.append(name)
        i = index_of.get(id(tensor))
        if i is not None:
            trainable_of[name] = engine.param_names[i]
        elif (home := HOMES.home_of(tensor)) is not None:  # a released stage-3 parameter's placeholder
            trainable_of[name] = home.name
    config = getattr(engine.module, "config", None)
    hf_config = config.to_dict() if config is not None and hasattr(config, "to_dict") else None
    return {"state_dict_keys": keys, "trainable_of": trainable_of,
            "hf_config": _json_or_error(hf_config, "the model's config") if hf_config else None,
            "class": type(engine.module).__name__}


def _extra_tensors(engine: "TrainingState", trainable_keys: set[str]) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", copy=True).contiguous()
            for name, t in engine.module.state_dict(keep_vars=True).items() if name not in trainable_keys}


def _manifest(engine: "TrainingState", tag: str, client_state: Any, files: dict[str, Any]) -> dict[str, Any]:
    model = _model_description(engine)
    buckets = []
    for bucket, (chunk_numel, chunks) in zip(engine.flat.layout.buckets, chunk_layout(engine)):
        buckets.append({
            "index": bucket.index, "group": bucket.group_index, "numel": bucket.numel,
            "padded_numel": bucket.padded_numel, "chunk_numel": chunk_numel, "num_chunks": chunks,
            "params": [{"name": s.name, "offset": s.offset, "numel": s.numel, "shape": list(s.shape)}
                       for s in bucket.slots],
        })
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.state_dict()["param_groups"]]
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    loader = getattr(engine, "data_loader", None)
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "zeroshard_version": __version__,
        "tag": tag, "world_size": engine.world.world_size, "stage": engine.stage,
        # the dtype of the saved parameter chunks: fp32 masters under mixed precision
        "dtype": "float32" if engine.strategy.masters is not None else str(engine.flat.dtype).replace("torch.", ""),
        "compute_dtype": str(engine.flat.dtype).replace("torch.", ""),
        "buckets": buckets,
        "optimizer": {"class": type(engine.optimizer).__name__,
                      "param_groups": _json_or_error(groups, "the optimizer's hyperparameters")},
        "lr_scheduler": _json_or_error(scheduler, "the LR scheduler's state"),
        "engine": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                   "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps,
                   "loss_scaler": engine.loss_scaler.state_dict()},
        "loader": loader.state_dict() if loader is not None and hasattr(loader, "state_dict") else None,
        "client_state": _json_or_error(client_state, "client_state"),
        "model": model,
        "files": files,
    }


def save_checkpoint(engine: "TrainingState", save_dir: str | Path, tag: Optional[str] = None,
                    client_state: Any = None, save_latest: bool = True) -> Path:
    """Write a checkpoint of ``engine`` under ``save_dir/tag``; every rank must call it."""
    tag = tag or f"global_step{engine.global_steps}"
    root = Path(save_dir)
    staging = root / f".{tag}.incomplete"
    rank = engine.world.rank
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    barrier(engine, "checkpoint_start")
    mine = staging / rank_file(rank)
    save_file(rank_tensors(engine), str(mine))
    sidecar = {mine.name: {"bytes": mine.stat().st_size, "sha256": sha256_of(mine)}}
    if rank == 0:
        model = _model_description(engine)
        extra = _extra_tensors(engine, set(model["trainable_of"]))
        if extra:
            save_file(extra, str(staging / EXTRA_FILE))
            sidecar[EXTRA_FILE] = {"bytes": (staging / EXTRA_FILE).stat().st_size,
                                   "sha256": sha256_of(staging / EXTRA_FILE)}
    write_json_atomic(staging / f"rank{rank:05d}.json", sidecar)
    barrier(engine, "checkpoint_written")
    final = root / tag
    if rank == 0:
        files: dict[str, Any] = {}
        for r in range(engine.world.world_size):
            part = staging / f"rank{r:05d}.json"
            files.update(json.loads(part.read_text()))
            part.unlink()
        write_json_atomic(staging / MANIFEST, _manifest(engine, tag, client_state, files))
        old = replaced_dir(root, tag)
        if final.exists():  # re-saving a tag: the old one stays readable until the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        staging.rename(final)
        if save_latest:
            write_text_atomic(root / LATEST, tag)
        shutil.rmtree(old, ignore_errors=True)
    barrier(engine, "checkpoint_done")
    return final
