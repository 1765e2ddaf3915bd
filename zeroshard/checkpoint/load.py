"""Loading a checkpoint into an engine of any world size and any stage: no conversion step.

Each rank reads, from whatever files hold them, exactly the elements of the chunks it owns now
(its parameters and their optimizer moments), then the stage makes full parameters current where it
keeps them whole.  No rank reads more than its own share, except at stage 0, where every rank owns
everything.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from .format import CheckpointError, published_dir, resolve_tag  # resolve_tag: kept public under this name
from .reader import CheckpointReader

if TYPE_CHECKING:
    from .interface import TrainingState
    from ..sharding.layout import BucketLayout


def _check_model(engine: "TrainingState", reader: CheckpointReader, strict: bool) -> None:
    ours = {s.name: tuple(s.shape) for b in engine.flat.layout.buckets for s in b.slots}
    theirs = {name: reader.shape(name) for name in reader.param_names()}
    wrong = [f"{n} (checkpoint {theirs[n]}, model {ours[n]})" for n in ours if n in theirs and theirs[n] != ours[n]]
    missing = [n for n in ours if n not in theirs]
    unexpected = [n for n in theirs if n not in ours]
    problems = []
    if wrong:
        problems.append("shape mismatch: " + ", ".join(wrong))
    if strict and missing:
        problems.append("missing from the checkpoint: " + ", ".join(missing))
    if strict and unexpected:
        problems.append("not in the model: " + ", ".join(unexpected))
    if problems:
        raise CheckpointError(f"{reader.directory}: does not fit this model; " + "; ".join(problems))


def _own_range(engine: "TrainingState", bucket: "BucketLayout", chunk: torch.Tensor) -> int:
    """Where this rank's chunk starts inside the bucket (stage 0 owns the whole bucket)."""
    return 0 if chunk.numel() == bucket.padded_numel else engine.world.rank * chunk.numel()


def _fill(reader: CheckpointReader, bucket: "BucketLayout", start: int, target: torch.Tensor, key: str,
          known: set[str]) -> None:
    """Copy into ``target`` (a chunk starting at ``start`` in ``bucket``) every parameter element it holds."""
    end = start + target.numel()
    for slot in bucket.slots:
        lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
        if lo >= hi or slot.name not in known:
            continue
        values = reader.read(slot.name, key, lo - slot.offset, hi - slot.offset)
        target[lo - start: hi - start].copy_(values.to(target.dtype))


def load_checkpoint(engine: "TrainingState", load_dir: str | Path, tag: Optional[str] = None,
                    load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False
                    ) -> tuple[Optional[Path], Any]:
    """Load ``load_dir/tag`` (default: the tag named by ``latest``) into ``engine``; every rank calls it.

    Returns ``(path, client_state)`` as DeepSpeed does.
    """
    root = Path(load_dir)
    directory = published_dir(root, resolve_tag(root, tag))
    reader = CheckpointReader(directory)
    _check_model(engine, reader, load_module_strict)
    known = set(reader.param_names())
    with_optimizer = load_optimizer_states and not load_module_only
    keys = reader.optimizer_state_keys() if with_optimizer else []
    with torch.no_grad():
        for bucket in engine.flat.layout.buckets:
            values, state, scalars = engine.updater.read_bucket(bucket)
            start = _own_range(engine, bucket, values)
            _fill(reader, bucket, start, values, "param", known)
            if keys:
                for key in keys:
                    buffer = state.get(key)
                    if buffer is None or buffer.numel() != values.numel():
                        buffer = torch.zeros_like(values)
                        state[key] = buffer
                    _fill(reader, bucket, start, buffer.view(-1), f"optim.{key}", known)
                first = next((s.name for s in bucket.slots if s.name in known), None)
                if first is not None:
                    scalars = {k: v.clone() for k, v in reader.scalar_state(reader.bucket_of(first)).items()}
            # writes the values (and the state) where they live, and publishes masters into the parameters
            engine.updater.write_bucket(bucket, values, state if keys else None, scalars)
        _load_extra(engine, reader)
        for bucket in engine.flat.layout.buckets:
            engine.strategy.refresh_bucket(bucket)
        engine.strategy.finish_refresh()
    manifest = reader.data
    if not load_module_only:
        _load_engine_state(engine, reader, manifest, with_optimizer, load_lr_scheduler_states)
    return directory, manifest.get("client_state")


def _load_extra(engine: "TrainingState", reader: CheckpointReader) -> None:
    current = engine.module.state_dict(keep_vars=True)
    for name, value in reader.extra().items():
        if name in current:
            current[name].data.copy_(value)


def _load_engine_state(engine: "TrainingState", reader: CheckpointReader, manifest: dict, with_optimizer: bool,
                       with_scheduler: bool) -> None:
    counters = manifest["engine"]
    engine.global_steps = counters["global_steps"]
    engine.micro_steps = counters["micro_steps"]
    engine.global_samples = counters["global_samples"]
    engine.skipped_steps = counters.get("skipped_steps", 0)
    # A dynamic loss scale carries over only from one dynamically scaled fp16 run into another.
    saved_scaler = counters.get("loss_scaler")
    if saved_scaler is not None and saved_scaler.get("dynamic") and engine.loss_scaler.dynamic:
        engine.loss_scaler.load_state_dict(saved_scaler)
    if with_optimizer:
        saved = manifest["optimizer"]["param_groups"]
        if len(saved) == len(engine.optimizer.param_groups):
            for group, values in zip(engine.optimizer.param_groups, saved):
                group.update({k: tuple(v) if k == "betas" else v for k, v in values.items()})
    if with_scheduler and engine.lr_scheduler is not None and manifest.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(manifest["lr_scheduler"])
    if manifest["world_size"] == engine.world.world_size:
        rng = reader.rank_tensor(engine.world.rank, "rng.torch")
        if rng is not None:
            torch.set_rng_state(rng)
        cuda_rng = reader.rank_tensor(engine.world.rank, "rng.cuda")
        if cuda_rng is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda_rng)
    loader = getattr(engine, "data_loader", None)
    if loader is not None and manifest.get("loader") is not None and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(manifest["loader"])
