"""DeepSpeed's learning-rate schedules, as ordinary ``torch.optim.lr_scheduler.LRScheduler`` objects.

Each is stepped once per optimizer step (never on a skipped step), so ``state_dict()`` and resuming
behave as for any torch scheduler.  The formulas follow DeepSpeed's documentation:

- warmup (``log``): ``gamma = log(step + 1) / log(warmup_num_steps)``; (``linear``): ``step / warmup_num_steps``.
- ``WarmupLR``: ``min + (max - min) * gamma`` during warmup, then ``max``.
- ``WarmupDecayLR``: the same warmup, then linear decay to 0 at ``total_num_steps``.
- ``WarmupCosineLR``: a ratio of the optimizer's own lr: warmup from ``warmup_min_ratio`` to 1, then a
  cosine from 1 down to ``cos_min_ratio`` at ``total_num_steps``.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ..config.spec_params import SCHEDULER_PARAMS, resolve


def _warmup_gamma(step: int, warmup_steps: int, kind: str) -> float:
    if step >= warmup_steps:
        return 1.0
    if kind == "log":
        return math.log(step + 1) / math.log(warmup_steps) if warmup_steps > 1 else 1.0
    return step / warmup_steps


class WarmupLR(LRScheduler):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold."""

    def __init__(self, optimizer: Optimizer, warmup_min_lr: float = 0.0, warmup_max_lr: float = 1e-3,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_epoch: int = -1) -> None:
        self.min_lr, self.max_lr = warmup_min_lr, warmup_max_lr
        self.warmup_steps, self.warmup_type = int(warmup_num_steps), warmup_type
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, step: int) -> float:
        gamma = _warmup_gamma(step, self.warmup_steps, self.warmup_type)
        return self.min_lr + (self.max_lr - self.min_lr) * gamma

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return [self._lr_at(self.last_epoch) for _ in self.optimizer.param_groups]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR`` followed by a linear decay to zero at ``total_num_steps``."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 1e-3, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_epoch: int = -1) -> None:
        self.total_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch)

    def _lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return super()._lr_at(step)
        span = max(1, self.total_steps - self.warmup_steps)
        return self.max_lr * max(0.0, (self.total_steps - step) / span)


class WarmupCosineLR(LRScheduler):
    """A ratio of each group's base lr: warmup, then cosine annealing to ``cos_min_ratio``."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 1e-4, warmup_type: str = "log",
                 last_epoch: int = -1) -> None:
        self.total_steps, self.warmup_steps = int(total_num_steps), int(warmup_num_steps)
        self.min_ratio, self.cos_min_ratio, self.warmup_type = warmup_min_ratio, cos_min_ratio, warmup_type
        super().__init__(optimizer, last_epoch)

    def _ratio(self, step: int) -> float:
        if step < self.warmup_steps:
            gamma = _warmup_gamma(step, self.warmup_steps, self.warmup_type)
            return self.min_ratio + (1.0 - self.min_ratio) * gamma
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return [float(base) * self._ratio(self.last_epoch) for base in self.base_lrs]


_SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
VALID_LR_SCHEDULES = list(_SCHEDULERS)


def build_scheduler(type_name: str, params: dict, optimizer: Optimizer) -> LRScheduler:
    """The scheduler named by the config's ``scheduler`` block, with DeepSpeed's defaults filled in."""
    full = resolve(params, SCHEDULER_PARAMS[type_name], f"scheduler.params ({type_name})")
    return _SCHEDULERS[type_name](optimizer, **full)
