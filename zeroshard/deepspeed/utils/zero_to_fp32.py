"""``deepspeed.utils.zero_to_fp32``: full fp32 weights from a sharded checkpoint, DeepSpeed's three calls.

zeroshard's checkpoints keep fp32 values (the masters under mixed precision), so these read them
straight from the shards (:mod:`zeroshard.checkpoint.consolidate`); no process group is needed.
``get_fp32_state_dict_from_zero_checkpoint`` also reads DeepSpeed's own files (and universal folders).
``get_optim_files`` / ``get_model_state_files`` list a DeepSpeed-format directory's per-rank files
(``zero_<rank>_optim_states.pt``, ...), as tools that convert DeepSpeed checkpoints call them.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ...checkpoint.consolidate import consolidate, full_state_dict
from ...checkpoint.utils import rank_order
from ...checkpoint.deepspeed_format import DeepSpeedReader, deepspeed_directory

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_fp32_state_dict", "get_checkpoint_files", "get_optim_files",
           "get_model_state_files"]


def get_checkpoint_files(checkpoint_dir: str | os.PathLike[str], glob_pattern: str) -> list[str]:
    """The files of ``checkpoint_dir`` matching ``glob_pattern``, in rank order; none is a
    ``FileNotFoundError`` naming the pattern and the directory."""
    files = sorted(glob.glob(os.path.join(os.fspath(checkpoint_dir), glob_pattern)), key=rank_order)
    if not files:
        raise FileNotFoundError(f"no {glob_pattern} files in {os.fspath(checkpoint_dir)!r}")
    return files


def get_optim_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Every rank's optimizer-state file (``*_optim_states.pt``) of a DeepSpeed checkpoint, in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Every model-state file (``*_model_states.pt``) of a DeepSpeed checkpoint, in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def _refuse_excluding(exclude_frozen_parameters: bool) -> None:
    if exclude_frozen_parameters:
        raise ValueError("exclude_frozen_parameters=True is not supported: zeroshard's consolidated weights "
                         "hold every state-dict entry (load with strict=True)")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | Path, tag: Any = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The full model state dict in fp32 (``checkpoint_dir``: a save_dir with ``latest``, or a tag's
    directory; ``tag`` picks one under a save_dir)."""
    _refuse_excluding(exclude_frozen_parameters)
    del lazy_mode  # the values are materialised either way (use convert_... for bounded memory)
    tag_name = None if tag is None else str(tag)
    directory = deepspeed_directory(Path(checkpoint_dir), tag_name)
    if directory is None and tag_name is None and deepspeed_directory(Path(checkpoint_dir).parent,
                                                                      Path(checkpoint_dir).name) is not None:
        directory = Path(checkpoint_dir)
    if directory is not None:  # DeepSpeed's own files (or a universal folder)
        with DeepSpeedReader(directory) as reader:
            return reader.full_state_dict()
    return full_state_dict(checkpoint_dir, tag_name)


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | Path, tag: Any = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` (a plain module, CPU) and return it."""
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=True)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | Path, output_dir_or_file: str | Path,
                                               tag: Any = None, exclude_frozen_parameters: bool = False,
                                               safe_serialization: bool = True,
                                               max_shard_size: Optional[str] = None) -> Path:
    """Write the fp32 weights to a file or directory, one tensor in memory at a time.

    A directory receives ``model.safetensors`` (and ``config.json`` for a Hugging Face model);
    ``safe_serialization=False`` writes ``pytorch_model.bin`` instead (a torch pickle).
    """
    _refuse_excluding(exclude_frozen_parameters)
    if max_shard_size is not None:
        raise ValueError("max_shard_size is not supported: zeroshard writes one file")
    out = Path(output_dir_or_file)
    tag_name = None if tag is None else str(tag)
    if safe_serialization or out.suffix == ".safetensors":
        return consolidate(checkpoint_dir, out, "fp32", tag_name)
    target = out if out.suffix else out / "pytorch_model.bin"
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(full_state_dict(checkpoint_dir, tag_name), target)
    return target
