"""DeepSpeed's learning-rate schedules, as ordinary ``torch.optim.lr_scheduler.LRScheduler`` objects.

[Note: which lr an optimizer step uses]
A DeepSpeed schedule starts at iteration -1 and the engine steps it after every optimizer step, so
optimizer step k (counting from 1) runs with the schedule's value at iteration k - 2: the first step
uses the *starting* value (``warmup_min_lr`` for WarmupLR/WarmupDecayLR, 0 for WarmupCosineLR,
``cycle_min_lr`` for OneCycle, ``lr_range_test_min_lr`` for LRRangeTest), the second the value at
iteration 0, and so on.  torch's schedulers take their first step in the constructor (``last_epoch``
0 at once), so each class here computes with ``iteration = last_epoch - 1``: the same lr at every
global step as DeepSpeed, and torch's ``state_dict()`` / ``load_state_dict()`` for resuming.

The formulas (``i`` is the iteration, ``W = max(2, warmup_num_steps)``):
- warmup ``log``: ``gamma = log(i + 1) / log(W)``; ``linear``: ``i / W``; 1 once ``i >= W``.
- ``WarmupLR``: ``min + (max - min) * gamma`` (``warmup_max_lr`` defaults to the optimizer's lr).
- ``WarmupDecayLR``: the same, with ``gamma = max(0, (T - i) / max(1, T - W))`` after the warmup
  (``T`` = ``total_num_steps``): a linear decay back to ``min``.
- ``WarmupCosineLR``: a ratio of each group's own lr: warmup from ``warmup_min_ratio`` to 1, then
  ``cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2`` with ``p = min(1, (i - W + 1) / max(1, T - W))``.
- ``LRRangeTest``: ``min_lr * (1 + rate * (i + 1) / step_size)`` (the interval floored with ``staircase``).
- ``OneCycle``: a triangle from ``cycle_min_lr`` up to ``cycle_max_lr`` over ``cycle_first_step_size``
  iterations and back over ``cycle_second_step_size`` (optionally in stairs), then ``min / (1 + rate *
  i' / decay_step_size)``; with ``cycle_momentum`` Adam's beta1 moves inversely between
  ``cycle_max_mom`` and ``cycle_min_mom``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ..config.spec_params import SCHEDULER_PARAMS, resolve


class _DeepSpeedSchedule(LRScheduler):
    """A schedule whose value at DeepSpeed's iteration ``i`` is :meth:`lrs_at` (see the Note)."""

    @property
    def iteration(self) -> int:
        return self.last_epoch - 1

    def lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float | torch.Tensor]:
        return list(self.lrs_at(self.iteration))


def _warmup_gamma(i: int, warmup: int, kind: str) -> float:
    if i >= warmup:
        return 1.0
    return math.log(i + 1) / math.log(warmup) if kind == "log" else i / warmup


class WarmupLR(_DeepSpeedSchedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold."""

    def __init__(self, optimizer: Optimizer, warmup_min_lr: float = 0.0, warmup_max_lr: Optional[float] = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_epoch: int = -1) -> None:
        self.min_lr = warmup_min_lr
        self.max_lr = float(optimizer.param_groups[0]["lr"]) if warmup_max_lr is None else warmup_max_lr
        self.warmup_steps, self.warmup_type = max(2, int(warmup_num_steps)), warmup_type
        super().__init__(optimizer, last_epoch)

    def gamma(self, i: int) -> float:
        return _warmup_gamma(i, self.warmup_steps, self.warmup_type)

    def lrs_at(self, iteration: int) -> list[float]:
        lr = self.min_lr if iteration < 0 else self.min_lr + (self.max_lr - self.min_lr) * self.gamma(iteration)
        return [lr for _ in self.optimizer.param_groups]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR`` followed by a linear decay to ``warmup_min_lr`` at ``total_num_steps``."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 1e-3, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_epoch: int = -1) -> None:
        self.total_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch)

    def gamma(self, i: int) -> float:
        if i < self.warmup_steps:
            return super().gamma(i)
        return max(0.0, (self.total_steps - i) / max(1.0, self.total_steps - self.warmup_steps))


class WarmupCosineLR(_DeepSpeedSchedule):
    """A ratio of each group's base lr: warmup, then cosine annealing to ``cos_min_ratio``."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 1e-4, warmup_type: str = "log",
                 last_epoch: int = -1) -> None:
        self.total_steps, self.warmup_steps = int(total_num_steps), max(2, int(warmup_num_steps))
        self.min_ratio, self.cos_min_ratio, self.warmup_type = warmup_min_ratio, cos_min_ratio, warmup_type
        super().__init__(optimizer, last_epoch)

    def ratio(self, i: int) -> float:
        if i < 0:
            return 0.0
        if i < self.warmup_steps:
            return self.min_ratio + (1.0 - self.min_ratio) * _warmup_gamma(i, self.warmup_steps, self.warmup_type)
        progress = min(1.0, (i - self.warmup_steps + 1) / max(1, self.total_steps - self.warmup_steps))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def lrs_at(self, iteration: int) -> list[float]:
        return [float(base) * self.ratio(iteration) for base in self.base_lrs]


class LRRangeTest(_DeepSpeedSchedule):
    """Raise the lr from ``lr_range_test_min_lr`` by ``step_rate`` every ``step_size`` iterations."""

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr: float = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_epoch: int = -1) -> None:
        self.min_lr, self.step_size, self.rate = lr_range_test_min_lr, lr_range_test_step_size, lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_epoch)

    def lrs_at(self, iteration: int) -> list[float]:
        interval = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [self.min_lr * (1 + self.rate * interval) for _ in self.optimizer.param_groups]


class OneCycle(_DeepSpeedSchedule):
    """The 1Cycle policy: one triangle between ``cycle_min_lr`` and ``cycle_max_lr``, then decay; Adam's
    beta1 (``cycle_momentum``) moves the other way."""

    def __init__(self, optimizer: Optimizer, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: Optional[int] = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: Optional[int] = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_epoch: int = -1) -> None:
        self.first = float(cycle_first_step_size)
        self.second = float(cycle_second_step_size) if cycle_second_step_size is not None else self.first
        self.total = self.first + self.second
        self.first_stairs = cycle_first_stair_count
        self.second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        self.min_mom, self.max_mom, self.decay_mom_rate = cycle_min_mom, cycle_max_mom, decay_mom_rate
        # momentum is cycled only for optimizers that have betas (Adam, AdamW)
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        super().__init__(optimizer, last_epoch)

    def _scale(self, iteration: int) -> float:
        batch = iteration + 1
        x = 1.0 + batch / self.total - math.floor(1 + batch / self.total)
        ratio = self.first / self.total
        scale, stairs = (x / ratio, self.first_stairs) if x <= ratio else ((x - 1) / (ratio - 1), self.second_stairs)
        if stairs > 0:
            position = batch % self.total
            position = position * stairs / self.first if position <= self.first else \
                (self.total - position) * stairs / self.second
            scale = math.floor(position) / stairs
        return scale

    def _decays(self, rate: float) -> bool:
        return not (math.isclose(rate, 0) or math.isclose(self.decay_step_size, 0))

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < self.total:
            lr = self.min_lr + (self.max_lr - self.min_lr) * self._scale(iteration)
        elif self._decays(self.decay_lr_rate):
            lr = self.min_lr / (1 + self.decay_lr_rate * (iteration - self.total + 1) / self.decay_step_size)
        else:
            lr = self.min_lr
        return [lr for _ in self.optimizer.param_groups]

    def beta1_at(self, iteration: int) -> float:
        if iteration < 0:
            return self.min_mom  # DeepSpeed starts the momentum at its lower bound
        if iteration < self.total:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale(iteration)
        if self._decays(self.decay_mom_rate):
            return self.max_mom * (1 + self.decay_mom_rate * (iteration - self.total + 1) / self.decay_step_size)
        return self.max_mom

    def step(self, epoch: Optional[int] = None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group in self.optimizer.param_groups:
                group["betas"] = (self.beta1_at(self.iteration), 0.99)


_SCHEDULERS: dict[str, type[LRScheduler]] = {"LRRangeTest": LRRangeTest, "OneCycle": OneCycle, "WarmupLR": WarmupLR,
                                             "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
#: DeepSpeed's schedule names, as ``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` lists them
VALID_LR_SCHEDULES = list(_SCHEDULERS)


def build_scheduler(type_name: str, params: dict, optimizer: Optimizer) -> LRScheduler:
    """The scheduler named by the config's ``scheduler`` block, with DeepSpeed's defaults filled in."""
    full = resolve(params, SCHEDULER_PARAMS[type_name], f"scheduler.params ({type_name})")
    return _SCHEDULERS[type_name](optimizer, **full)
