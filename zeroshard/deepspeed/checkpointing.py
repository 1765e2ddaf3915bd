"""``zeroshard.checkpointing`` (DeepSpeed's ``deepspeed.checkpointing``): activation checkpointing.

At the path DeepSpeed scripts import: ``checkpoint``, ``checkpoint_modules``, ``use_settings``,
``take_profile`` and ``CheckpointProfile`` from :mod:`zeroshard.activations.checkpointing` (the
implementation), and DeepSpeed's ``configure`` / ``is_configured`` / ``reset``.  ``configure`` is
called by user scripts, never by zeroshard: it builds the settings from a config's
``activation_checkpointing`` block and its keyword arguments and hands them to ``use_settings``, as
the engine does with its own config's block when it is built.

[Note: DeepSpeed's settings as module attributes]
DeepSpeed keeps these settings as globals of this module (``PARTITION_ACTIVATIONS``,
``CPU_CHECKPOINT``, ``num_layers``, ...), and scripts and tests read and assign them directly.  Here
each is a property of the module object over the process-wide settings of
:mod:`zeroshard.activations.checkpointing`: reading one reads the settings in force, assigning one
changes them (validated as the config block is, so ``PARTITION_ACTIVATIONS = True`` is refused as the
config key is), so an assignment has the effect it has in DeepSpeed and never leaves a stale copy.
The module is also DeepSpeed's ``deepspeed.runtime.activation_checkpointing.checkpointing`` (one
object under both names).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any, Optional

from ..activations import checkpointing as _impl
from ..activations.checkpointing import CheckpointProfile, checkpoint, checkpoint_modules, take_profile, use_settings
from ..config import load_config
from ..config.loader import read_config_source
from ..config.schema import ActivationCheckpointingConfig

__all__ = ["checkpoint", "checkpoint_modules", "configure", "is_configured", "reset", "CheckpointProfile",
           "take_profile", "use_settings", "ContiguousCheckpointingError"]


class ContiguousCheckpointingError(AssertionError):
    """``contiguous_checkpointing`` asked for without what it needs (partitioned activations, a number
    of checkpoints).  An AssertionError, as DeepSpeed raises it, so callers that catch that keep working."""


def _checked(block: dict[str, Any]) -> ActivationCheckpointingConfig:
    """The settings of an ``activation_checkpointing`` block, validated as the config's is.

    The contiguous buffer's own prerequisites are checked first, as DeepSpeed checks them, so that an
    incomplete request is told what is missing before being told zeroshard refuses the feature."""
    if block.get("contiguous_memory_optimization"):
        if not block.get("partition_activations"):
            raise ContiguousCheckpointingError("contiguous checkpointing is only available with partitioned "
                                               "activations: set partition_activations as well")
        if block.get("number_checkpoints") is None:
            raise ContiguousCheckpointingError("Must specify the number of layers with contiguous memory "
                                               "checkpointing (num_checkpoints / number_checkpoints)")
    return load_config({"activation_checkpointing": block}).activation_checkpointing

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
    _impl.use_settings(_checked(block))
    _configured[0] = True


def is_configured() -> bool:
    """True once :func:`configure` has been called in this process."""
    return _configured[0]


def reset() -> None:
    """DeepSpeed clears its per-iteration buffers here; zeroshard keeps none between regions."""




def _setting(key: str, doc: str) -> property:
    """A module attribute reading and assigning one key of the process-wide settings (see [Note:
    DeepSpeed's settings as module attributes])."""

    def read(module: types.ModuleType) -> Any:
        return getattr(_impl.current_process_settings(), key)

    def assign(module: types.ModuleType, value: Any) -> None:
        _impl.use_settings(_checked({**dataclasses.asdict(_impl.current_process_settings()), key: value}))

    return property(read, assign, doc=doc)


def _read_mpu(module: types.ModuleType) -> None:
    return None


def _assign_mpu(module: types.ModuleType, value: Any) -> None:
    if value is not None:
        raise ValueError("checkpointing.mpu: zeroshard's activation checkpointing has no model parallelism; "
                         "only None can be assigned")


def _read_enabled(module: types.ModuleType) -> bool:
    return _configured[0]


def _assign_enabled(module: types.ModuleType, value: bool) -> None:
    _configured[0] = bool(value)


class _CheckpointingModule(types.ModuleType):
    """This module, with DeepSpeed's setting globals as properties."""

    PARTITION_ACTIVATIONS = _setting("partition_activations", "Partition saved activations (refused when True).")
    CONTIGUOUS_CHECKPOINTING = _setting("contiguous_memory_optimization",
                                        "Pack partitioned activations in one buffer (refused when True).")
    num_layers = _setting("number_checkpoints", "The contiguous buffer's number of checkpoints.")
    CPU_CHECKPOINT = _setting("cpu_checkpointing", "Keep checkpointed inputs in host memory.")
    SYNCHRONIZE = _setting("synchronize_checkpoint_boundary", "Synchronize the device at region boundaries.")
    PROFILE_TIME = _setting("profile", "Time checkpointed forwards and recomputations.")
    mpu = property(_read_mpu, _assign_mpu, doc="DeepSpeed's model-parallel unit: always None here.")
    deepspeed_checkpointing_enabled = property(_read_enabled, _assign_enabled,
                                               doc="True once configure() has been called (is_configured()).")


sys.modules[__name__].__class__ = _CheckpointingModule
