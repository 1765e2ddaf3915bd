"""Offline tools (no process group, any machine): consolidate a checkpoint into one ordinary model file,
and describe what a checkpoint holds.

``consolidate`` writes a safetensors file with the model's own state-dict names (a tied weight under
each of its names, as ``load_state_dict(strict=True)`` expects), one tensor at a time: its peak memory
is about one parameter plus the slices it is assembled from, never the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from ..precision.policy import DTYPES
from .format import LATEST, MANIFEST, published_dir, resolve_tag, write_safetensors_streaming
from .reader import CheckpointReader
from .tensor_parts import TensorPartsReader, is_tensor_parallel_job


def find_checkpoint(path: str | Path, tag: Optional[str] = None) -> Path:
    """A checkpoint directory: ``path/tag``, else ``path`` itself when it is a checkpoint or has no
    ``latest`` file, else ``path/<latest>``."""
    path = Path(path)
    if tag is None and ((path / MANIFEST).is_file() or not (path / LATEST).is_file()):
        return path
    return published_dir(path, resolve_tag(path, tag))


def open_reader(checkpoint: str | Path, tag: Optional[str] = None) -> Union[CheckpointReader, TensorPartsReader]:
    """A checkpoint's reader; a tensor-parallel job's parts joined into the whole model's tensors (see
    [Note: a tensor-parallel checkpoint read at another size] in checkpoint/tensor_parts.py)."""
    if is_tensor_parallel_job(Path(checkpoint)):
        return TensorPartsReader(Path(checkpoint), tag)
    return CheckpointReader(find_checkpoint(checkpoint, tag))


def consolidate(checkpoint: str | Path, out: str | Path, dtype: str = "fp32", tag: Optional[str] = None,
                trainable_only: bool = False) -> Path:
    """Write the full model weights of a checkpoint to ``out``.

    ``out`` ending in ``.safetensors`` is the file; otherwise it is a directory that receives
    ``model.safetensors`` (and ``config.json`` for a Hugging Face model, so that
    ``from_pretrained(out)`` works).  ``trainable_only``: only the trained parameters (see
    :func:`consolidate_trainable`).
    """
    if trainable_only:
        return consolidate_trainable(checkpoint, out, dtype, tag)
    with open_reader(checkpoint, tag) as reader:
        model = reader.data["model"]
        out = Path(out)
        if out.suffix == ".safetensors":
            out.parent.mkdir(parents=True, exist_ok=True)
            target = out
        else:
            out.mkdir(parents=True, exist_ok=True)
            target = out / "model.safetensors"
            if model.get("hf_config"):
                (out / "config.json").write_text(json.dumps(model["hf_config"], indent=2))
        entries, produce = _full_weights(reader, DTYPES[dtype])
        write_safetensors_streaming(target, entries, produce)
    return target


def consolidate_trainable(checkpoint: str | Path, out: str | Path, dtype: str = "fp32",
                          tag: Optional[str] = None) -> Path:
    """Write only the trained parameters of a checkpoint into the directory ``out``.

    [Note: an adapter out of a checkpoint]
    For a peft model (the manifest holds its ``peft_config``) the directory is a peft adapter, as
    ``PeftModel.save_pretrained`` writes one: ``adapter_config.json`` and ``adapter_model.safetensors``,
    whose keys are the trained parameters' state-dict names without the adapter's name
    (``...q_proj.lora_A.default.weight`` is stored as ``...q_proj.lora_A.weight``), so that
    ``PeftModel.from_pretrained(base, out)`` loads it.  For any other model it is
    ``model.safetensors`` with the trained parameters under their state-dict names (a partial state
    dict: ``load_state_dict(..., strict=False)``).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open_reader(checkpoint, tag) as reader:
        model = reader.data["model"]
        trainable_of: dict[str, str] = model["trainable_of"]
        peft_configs: Optional[dict[str, Any]] = model.get("peft_config")
        cast = DTYPES[dtype]
        names = {key: key for key in model["state_dict_keys"] if key in trainable_of}
        target = out / "model.safetensors"
        if peft_configs:
            if len(peft_configs) != 1:
                raise ValueError(f"the checkpoint's model has {len(peft_configs)} peft adapters "
                                 f"({', '.join(peft_configs)}); --trainable-only writes one adapter")
            adapter, config = next(iter(peft_configs.items()))
            names = {key: key.replace(f".{adapter}.", ".") for key in names}
            (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
            target = out / "adapter_model.safetensors"
        entries = [(names[key], reader.shape(trainable_of[key]), cast) for key in names]
        source = {stored: key for key, stored in names.items()}
        write_safetensors_streaming(target, entries, lambda stored: reader.tensor(trainable_of[source[stored]]))
    return target


def _full_weights(reader: Union[CheckpointReader, TensorPartsReader], cast: torch.dtype
                  ) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], Callable[[str], torch.Tensor]]:
    """Every state-dict entry's name, shape and dtype, and a function producing its full values
    (frozen parameters only when the checkpoint holds them)."""
    model = reader.data["model"]
    trainable_of: dict[str, str] = model["trainable_of"]
    extra = reader.extra()
    entries = []
    for key in model["state_dict_keys"]:
        if key in trainable_of:
            entries.append((key, reader.shape(trainable_of[key]), cast))
        elif key in extra:
            t = extra[key]
            entries.append((key, tuple(t.shape), cast if t.is_floating_point() else t.dtype))
        # otherwise a frozen parameter left out (save_checkpoint(exclude_frozen_parameters=True))

    def produce(key: str) -> torch.Tensor:
        return reader.tensor(trainable_of[key]) if key in trainable_of else extra[key]

    return entries, produce


def full_state_dict(checkpoint: str | Path, tag: Optional[str] = None, dtype: torch.dtype = torch.float32
                    ) -> dict[str, torch.Tensor]:
    """A checkpoint's full weights as an ordinary state dict in host memory (the whole model at once:
    for a file on disk with bounded memory use :func:`consolidate`)."""
    with open_reader(checkpoint, tag) as reader:
        entries, produce = _full_weights(reader, dtype)
        return {key: produce(key).to(want) for key, _, want in entries}


def describe(checkpoint: str | Path, tag: Optional[str] = None) -> str:
    """A human-readable summary of a checkpoint (``zeroshard ckpt-info``)."""
    directory = find_checkpoint(checkpoint, tag)
    with CheckpointReader(directory) as reader:
        d: dict[str, Any] = reader.data
        bad = nonfinite_tensors(reader)
    numel = sum(b["numel"] for b in d["buckets"])
    lines = [
        f"checkpoint   {directory}",
        f"format       {d['format']} v{d['format_version']} (zeroshard {d['zeroshard_version']})",
        f"saved by     world size {d['world_size']}, ZeRO stage {d['stage']}, dtype {d['dtype']}",
        f"model        {d['model']['class']}: {numel:,} trainable parameters in {len(d['buckets'])} buckets, "
        f"{len(d['model']['state_dict_keys'])} state-dict entries",
        f"optimizer    {d['optimizer']['class']}, {len(d['optimizer']['param_groups'])} group(s)",
        f"progress     global step {d['engine']['global_steps']}, {d['engine']['global_samples']:,} samples",
        f"scheduler    {'saved' if d.get('lr_scheduler') else 'none'}; data loader position "
        f"{'saved' if d.get('loader') else 'none'}; client state {'saved' if d.get('client_state') else 'none'}",
        f"files        {len(d['files'])}, {sum(f['bytes'] for f in d['files'].values()):,} bytes (checksums verified)",
    ]
    lines.append(f"values       {'all finite' if not bad else 'NOT FINITE: ' + ', '.join(bad)}")
    return "\n".join(lines)


def nonfinite_tensors(reader: CheckpointReader) -> list[str]:
    """Every saved tensor (parameters, optimizer state, frozen parameters and buffers) holding a NaN or
    an infinity, read one parameter at a time."""
    bad = []
    keys = ["param"] + [f"optim.{k}" for k in reader.optimizer_state_keys()]
    for name in reader.param_names():
        for key in keys:
            values = reader.read(name, key)
            if values.is_floating_point() and not bool(torch.isfinite(values).all()):
                bad.append(name if key == "param" else f"{name} ({key[len('optim.'):]})")
    for name, tensor in reader.extra().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad.append(name)
    return bad
