"""``zeroshard.checkpointing`` (DeepSpeed's ``deepspeed.checkpointing``): activation checkpointing.

At the path DeepSpeed scripts import: ``checkpoint``, ``checkpoint_modules``, ``use_settings``,
``take_profile`` and ``CheckpointProfile`` from :mod:`zeroshard.activations.checkpointing` (the
implementation), and DeepSpeed's ``configure`` / ``is_configured`` / ``reset``.  ``configure`` is
called by user scripts, never by zeroshard: it builds the settings from a config's
``activation_checkpointing`` block and its keyword arguments and hands them to ``use_settings``, as
the engine does with its own config's block when it is built.
"""

from __future__ import annotations

from typing import Any, Optional

from ..activations import checkpointing as _impl
from ..activations.checkpointing import CheckpointProfile, checkpoint, checkpoint_modules, take_profile, use_settings
from ..config import load_config
from ..config.loader import read_config_source

__all__ = ["checkpoint", "checkpoint_modules", "configure", "is_configured", "reset", "CheckpointProfile",
           "take_profile", "use_settings"]

_configured = [False]


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """Set the activation-checkpointing options, as DeepSpeed's ``configure`` does.

    The config's ``activation_checkpointing`` block is read (``deepspeed_config``: a path or dict),
    then the keyword arguments that are not None override it; the result is validated like the
    config block (partitioning options need tensor parallelism and are refused).  ``mpu_`` must be
    None: zeroshard has no model parallelism.
    """
    if mpu_ is not None:
        raise ValueError("checkpointing.configure(mpu_=...): zeroshard has no model parallelism; pass None")
    block = dict(read_config_source(deepspeed_config).get("activation_checkpointing", {})) \
        if deepspeed_config is not None else {}
    overrides = {"partition_activations": partition_activations,
                 "contiguous_memory_optimization": contiguous_checkpointing,
                 "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
                 "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    block.update({k: v for k, v in overrides.items() if v is not None})
    _impl.use_settings(load_config({"activation_checkpointing": block}).activation_checkpointing)
    _configured[0] = True


def is_configured() -> bool:
    """True once :func:`configure` has been called in this process."""
    return _configured[0]


def reset() -> None:
    """DeepSpeed clears its per-iteration buffers here; zeroshard keeps none between regions."""


