"""An engine's save in DeepSpeed's layout (``checkpoint.format: "deepspeed"``, or ``save_checkpoint(...,
format="deepspeed")``).

[Note: a save in DeepSpeed's layout]
The engine first saves its own checkpoint, as always (every rank its share, streamed), into a hidden
directory under ``save_dir``; rank 0 then reads it whole and writes DeepSpeed's files for the engine's
world size and stage (writer.py), and removes the hidden copy.  Going through zeroshard's own format
keeps one save path for every stage and offload (DeepSpeed's files are whole partitions of a layout
zeroshard does not keep in memory), at the cost of writing the state twice and rank 0 holding it
whole once; the save is synchronous.  Every rank learns rank 0's outcome, so a failure raises the
same error everywhere.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from ..format import CheckpointError
from ..reader import CheckpointReader
from .writer import write_deepspeed

#: the hidden directory under ``save_dir`` that holds zeroshard's own save while it is rewritten
STAGING_DIR = ".zeroshard-for-deepspeed"


def save_in_deepspeed_layout(saved: Path, save_dir: Path, save_latest: bool, world_size: int,
                             ds_config: dict[str, Any], is_main: bool,
                             agree: Callable[[str], list[Any]]) -> Path:
    """Rewrite the zeroshard checkpoint ``saved`` (under ``save_dir/STAGING_DIR``) as DeepSpeed's
    ``save_dir/<tag>`` (see [Note: a save in DeepSpeed's layout]); ``agree`` gathers each rank's error
    message ("" for none)."""
    error = ""
    if is_main:
        try:
            if (ds_config.get("fp16") or {}).get("enabled"):
                raise CheckpointError("DeepSpeed's layout is written for fp32 or bf16 training, not fp16")
            dtype = torch.bfloat16 if (ds_config.get("bf16") or {}).get("enabled") else torch.float32
            clip = ds_config.get("gradient_clipping")
            with CheckpointReader(saved) as reader:
                write_deepspeed(reader, save_dir, saved.name, world_size, int(ds_config["zero_optimization"]["stage"]),
                                dtype, clip_grad=None if clip is None else float(clip), ds_config=ds_config,
                                save_latest=save_latest)
        except Exception as err:  # every rank raises it below
            error = f"{type(err).__name__}: {err}"
        finally:
            shutil.rmtree(save_dir / STAGING_DIR, ignore_errors=True)
    errors = [e for e in agree(error) if e]
    if errors:
        raise CheckpointError(f"save_checkpoint in DeepSpeed's layout: {errors[0]}")
    return save_dir / saved.name
