"""``zeroshard.checkpointing`` (DeepSpeed's ``deepspeed.checkpointing``): activation checkpointing.

The implementation is :mod:`zeroshard.activation_checkpointing` (this name is kept because DeepSpeed
scripts import it): ``checkpoint``, ``checkpoint_modules``, and DeepSpeed's ``configure`` /
``is_configured`` / ``reset``.
"""

from .activation_checkpointing import CheckpointProfile, checkpoint, checkpoint_modules, take_profile, use_settings
from .compat.activation_checkpointing import configure, is_configured, reset

__all__ = ["checkpoint", "checkpoint_modules", "configure", "is_configured", "reset", "CheckpointProfile",
           "take_profile", "use_settings"]
