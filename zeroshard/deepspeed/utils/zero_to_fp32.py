"""``deepspeed.utils.zero_to_fp32``: full fp32 weights from a sharded checkpoint, DeepSpeed's three calls.

zeroshard's checkpoints keep fp32 values (the masters under mixed precision), so these read them
straight from the shards (:mod:`zeroshard.checkpoint.consolidate`); no process group is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ...checkpoint.consolidate import consolidate, full_state_dict

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_fp32_state_dict"]


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
    return full_state_dict(checkpoint_dir, None if tag is None else str(tag))


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
