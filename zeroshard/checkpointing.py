"""``zeroshard.checkpointing`` (DeepSpeed's ``deepspeed.checkpointing``): activation checkpointing.

This module only re-exports, at the path DeepSpeed scripts import: ``checkpoint``,
``checkpoint_modules``, ``use_settings``, ``take_profile`` and ``CheckpointProfile`` from
:mod:`zeroshard.activation_checkpointing` (the implementation), and DeepSpeed's ``configure`` /
``is_configured`` / ``reset`` from :mod:`zeroshard.compat.activation_checkpointing`.
``configure`` is called by user scripts, never by zeroshard: it builds the settings from a config's
``activation_checkpointing`` block and its keyword arguments and hands them to ``use_settings``, as
the engine does with its own config's block when it is built.
"""

from .activation_checkpointing import CheckpointProfile, checkpoint, checkpoint_modules, take_profile, use_settings
from .compat.activation_checkpointing import configure, is_configured, reset

__all__ = ["checkpoint", "checkpoint_modules", "configure", "is_configured", "reset", "CheckpointProfile",
           "take_profile", "use_settings"]
