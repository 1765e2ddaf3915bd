"""Optimizer wrapping, LR schedules and sharded gradient clipping."""

from .builder import from_config, from_user
from .clipping import clip_, clip_coefficient, global_grad_norm
from .schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler

__all__ = ["from_config", "from_user", "clip_", "clip_coefficient", "global_grad_norm", "build_scheduler", "WarmupLR",
           "WarmupDecayLR", "WarmupCosineLR"]
