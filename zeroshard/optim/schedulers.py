"""DeepSpeed's learning-rate schedules (``deepspeed.runtime.lr_schedules``), usable as
``torch.optim.lr_scheduler.LRScheduler`` objects.

[Note: which lr an optimizer step uses]
A schedule counts DeepSpeed's way: ``last_batch_iteration`` starts at -1, construction writes the
schedule's value at -1 into the optimizer (``warmup_min_lr`` for WarmupLR/WarmupDecayLR, 0 for
WarmupCosineLR, ``cycle_min_lr`` for OneCycle, ``lr_range_test_min_lr`` for LRRangeTest), and each
``step()`` adds one to the counter and writes the value there; ``step(n)`` jumps to iteration ``n``.
The engine steps the schedule after every optimizer step (not after a skipped one), so optimizer
step k (counting from 1) runs with the value at iteration k - 2.  ``get_lr()`` is the value at the
current iteration, ``get_last_lr()`` what was last written, ``state_dict()`` is DeepSpeed's
``{"last_batch_iteration": n}``.  The classes derive from torch's ``LRScheduler`` (so they are
accepted wherever one is) but do not use its epoch counting: torch steps once in its constructor.

The formulas (``i`` is the iteration, ``W = max(2, warmup_num_steps)``):
- warmup ``log``: ``gamma = log(i + 1) / log(W)``; ``linear``: ``i / W``; 1 once ``i >= W``.  Any
  other ``warmup_type`` is logged and treated as ``log``.
- ``WarmupLR``: ``min + (max - min) * gamma`` per group (``warmup_max_lr`` defaults to each group's lr).
- ``WarmupDecayLR``: the same, with ``gamma = max(0, (T - i) / max(1, T - W))`` after the warmup
  (``T`` = ``total_num_steps``): a linear decay back to ``min``.
- ``WarmupCosineLR``: a ratio of each group's lr at construction: warmup from ``warmup_min_ratio`` to 1,
  then ``cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2`` with
  ``p = min(1, (i - W + 1) / max(1, T - W))``; 0 before iteration 0.
- ``LRRangeTest``: ``min_lr * (1 + rate * (i + 1) / step_size)`` (the interval floored with ``staircase``).
- ``OneCycle``: a triangle from ``cycle_min_lr`` up to ``cycle_max_lr`` over ``cycle_first_step_size``
  iterations and back over ``cycle_second_step_size`` (optionally in stairs), then
  ``min / (1 + rate * i' / decay_step_size)`` (``i' = i - total + 1``); with ``cycle_momentum`` Adam's
  beta1 moves inversely between ``cycle_max_mom`` and ``cycle_min_mom`` (beta2 is set to 0.99, as
  DeepSpeed does), and the optimizer starts at ``cycle_min_mom``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional, Sequence, Union

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ..config.spec_params import SCHEDULER_PARAMS, resolve

logger = logging.getLogger(__name__)

#: a value for every param group, or one for all of them
PerGroup = Union[float, Sequence[float]]
WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer: Optimizer, value: Any, name: str) -> list[Any]:
    """``value`` once per param group: a list/tuple must have exactly one entry per group."""
    count = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name}: expected {count} values (one per param group), got {len(value)}")
        return list(value)
    return [value] * count


def _write_lrs(optimizer: Optimizer, lrs: Sequence[Any]) -> list[Any]:
    """Set each group's lr (a tensor lr is filled in place, keeping its identity); returns the groups' lrs."""
    for group, lr in zip(optimizer.param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr.squeeze() if isinstance(lr, torch.Tensor) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


def _checked_warmup(warmup_num_steps: Any, warmup_type: str) -> tuple[int, str]:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in WARMUP_TYPES:
        logger.warning("unknown warmup_type %r: using 'log'", warmup_type)
        warmup_type = "log"
    return max(2, warmup_num_steps), warmup_type


def _warmup_gamma(i: int, warmup: int, kind: str) -> float:
    if i >= warmup:
        return 1.0
    return math.log(i + 1) / math.log(warmup) if kind == "log" else i / warmup


class _DeepSpeedSchedule(LRScheduler):
    """A schedule whose lrs at iteration ``last_batch_iteration`` are :meth:`get_lr` (see the Note)."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int) -> None:
        # torch's constructor takes a step at once; DeepSpeed's schedules start at iteration -1
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer")
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._written: Optional[list[Any]] = None  # the lrs last written into the optimizer

    def _start(self) -> None:
        """Write the starting lrs into the optimizer, for a schedule that starts from the beginning."""
        if self.last_batch_iteration == -1:
            self._written = _write_lrs(self.optimizer, self.get_lr())

    @property
    def last_epoch(self) -> int:
        """torch's name for the counter: here it is DeepSpeed's ``last_batch_iteration``."""
        return self.last_batch_iteration

    @last_epoch.setter
    def last_epoch(self, value: int) -> None:
        self.last_batch_iteration = value

    def get_lr(self) -> list[Any]:
        raise NotImplementedError

    def get_last_lr(self) -> list[Any]:
        """The lrs last written into the optimizer."""
        if self._written is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr(): call step() first")
        return self._written

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Move to ``last_batch_iteration`` (default: the next iteration) and write its lrs."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._written = _write_lrs(self.optimizer, self.get_lr())

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "last_batch_iteration" in state_dict:
            self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        else:  # torch's form of the counter (``last_epoch``), which runs one ahead of DeepSpeed's iteration
            self.last_batch_iteration = int(state_dict["last_epoch"]) - 1


class WarmupLR(_DeepSpeedSchedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold."""

    def __init__(self, optimizer: Optimizer, warmup_min_lr: PerGroup = 0.0, warmup_max_lr: Optional[PerGroup] = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.warmup_num_steps, self.warmup_type = _checked_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [high - low for high, low in zip(self.max_lrs, self.min_lrs)]
        self._start()

    def _get_gamma(self) -> float:
        return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> list[Any]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR`` followed by a linear decay to ``warmup_min_lr`` at ``total_num_steps``."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr: PerGroup = 0.0,
                 warmup_max_lr: PerGroup = 1e-3, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)

    def _get_gamma(self) -> float:
        i = self.last_batch_iteration
        if i < self.warmup_num_steps:
            return super()._get_gamma()
        return max(0.0, (self.total_num_steps - i) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_DeepSpeedSchedule):
    """A ratio of each group's lr (as it was at construction): warmup, then cosine annealing to
    ``cos_min_ratio``."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 1e-4, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.warmup_num_steps, self.warmup_type = _checked_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps, self.warmup_min_ratio, self.cos_min_ratio = total_num_steps, warmup_min_ratio, cos_min_ratio
        if total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)
        self.org_lrs = [group["lr"].clone() if isinstance(group["lr"], torch.Tensor) else group["lr"]
                        for group in optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        """The factor of each group's original lr at the current iteration."""
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            gamma = _warmup_gamma(i, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        # clamped: past total_num_steps (or with no decay window at all) the ratio stays at the floor
        progress = min(1.0, (i - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def get_lr(self) -> list[Any]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class LRRangeTest(_DeepSpeedSchedule):
    """Raise the lr from ``lr_range_test_min_lr`` by ``step_rate`` every ``step_size`` iterations."""

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr: PerGroup = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        if isinstance(lr_range_test_step_size, bool) or not isinstance(lr_range_test_step_size, int) \
                or lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size!r}")
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size, self.step_rate = lr_range_test_step_size, lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start()

    def _interval(self) -> float:
        interval = (self.last_batch_iteration + 1) / self.step_size
        return float(math.floor(interval)) if self.staircase else interval

    def get_lr(self) -> list[Any]:
        increase = 1 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]


class OneCycle(_DeepSpeedSchedule):
    """The 1Cycle policy: one triangle between ``cycle_min_lr`` and ``cycle_max_lr``, then decay; Adam's
    beta1 (``cycle_momentum``) moves the other way."""

    def __init__(self, optimizer: Optimizer, cycle_min_lr: PerGroup, cycle_max_lr: PerGroup,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: Optional[int] = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: PerGroup = 0.8, cycle_max_mom: PerGroup = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        # a zero first half would divide by step_ratio = 0; a zero second half is a plain ramp
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size}")
        super().__init__(optimizer, last_batch_iteration)
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size

        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = math.isclose(decay_step_size, 0)

        # momentum is cycled only for optimizers that have betas (Adam, AdamW)
        self.cycle_momentum = cycle_momentum
        if cycle_momentum and "betas" not in optimizer.defaults:
            logger.warning("OneCycle: %s has no betas, so cycle_momentum is off", type(optimizer).__name__)
            self.cycle_momentum = False
        if self.cycle_momentum:
            self.decay_mom_rate = decay_mom_rate
            self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
            self.skip_mom_decay = self.skip_mom_decay or math.isclose(decay_mom_rate, 0)

        if last_batch_iteration == -1:  # DeepSpeed starts at the bottom of both ranges
            self._written = _write_lrs(optimizer, self.min_lrs)
            if self.cycle_momentum:
                for group, betas in zip(optimizer.param_groups, self.min_moms):
                    group["betas"] = betas

    def _get_scale_factor(self) -> float:
        batch = self.last_batch_iteration + 1
        x = 1.0 + batch / self.total_size - math.floor(1 + batch / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # counted from the whole batch offset: a float scale just under a stair would floor a stair low
            position = batch % self.total_size
            if position <= self.first_step_size:
                position = position * stairs / self.first_step_size
            else:
                position = (self.total_size - position) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[Any]:
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval()
        return [low / factor for low in self.min_lrs]

    def get_mom(self) -> Optional[list[tuple[float, float]]]:
        """Each group's ``betas`` at the current iteration, or None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [(high[0] - (high[0] - low[0]) * scale, low[1]) for low, high in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_interval()
        return [(beta1 * factor, beta2) for beta1, beta2 in self.max_moms]

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        super().step(last_batch_iteration)
        momentums = self.get_mom()
        if momentums is not None:
            for group, betas in zip(self.optimizer.param_groups, momentums):
                group["betas"] = betas


_SCHEDULERS: dict[str, type[LRScheduler]] = {"LRRangeTest": LRRangeTest, "OneCycle": OneCycle, "WarmupLR": WarmupLR,
                                             "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
#: DeepSpeed's schedule names, as ``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` lists them
VALID_LR_SCHEDULES = list(_SCHEDULERS)


def build_scheduler(type_name: str, params: dict, optimizer: Optimizer) -> LRScheduler:
    """The scheduler named by the config's ``scheduler`` block, with DeepSpeed's defaults filled in."""
    full = resolve(params, SCHEDULER_PARAMS[type_name], f"scheduler.params ({type_name})")
    return _SCHEDULERS[type_name](optimizer, **full)
