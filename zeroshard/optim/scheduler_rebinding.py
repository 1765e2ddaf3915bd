"""A learning-rate scheduler built on another optimizer than the engine's, moved onto the engine's.

[Note: a scheduler built before initialize()]
DeepSpeed accepts a scheduler object built on some optimizer over the model's parameters while the
engine builds its own optimizer (from the config, or from a callable), and hands that object back.
Under DeepSpeed the scheduler then keeps driving the optimizer it was built on, which nothing
steps: the schedule has no effect on training.  zeroshard moves the scheduler onto the engine's
optimizer instead, so the object handed back is the schedule training follows: each of the engine's
groups takes the scheduler's current learning rate and the values the scheduler keeps in its groups
(``initial_lr``, a cycling scheduler's ``max_lr`` and momentum), the scheduler keeps its own state
(``last_epoch``, ``base_lrs``, its lambdas), and its ``optimizer`` becomes the engine's.  That needs
the two optimizers to group the parameters alike (as many groups, in the same order) and the
scheduler's optimizer to hold the model's parameters; anything else is refused, since no group of
the engine's would be the one the scheduler meant.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from ..errors import InitializeArgumentError

#: group keys a momentum-cycling scheduler (OneCycleLR, CyclicLR) writes besides the learning rate
_MOMENTUM_KEYS = ("momentum", "betas")


def rebind_scheduler(scheduler: LRScheduler, engine_optimizer: Optimizer,
                     model_parameters: Iterable[torch.Tensor]) -> LRScheduler:
    """Move ``scheduler`` from the optimizer it was built on onto ``engine_optimizer`` (see [Note: a
    scheduler built before initialize()]); returns it."""
    built_on = scheduler.optimizer
    ours = {id(p) for p in model_parameters}
    foreign = [p for group in built_on.param_groups for p in group["params"] if id(p) not in ours]
    if foreign:
        raise InitializeArgumentError(
            f"initialize(lr_scheduler=...) got a scheduler built on an optimizer over {len(foreign)} tensors that "
            f"are not the model's parameters; build it on the optimizer you pass to initialize(), or pass a "
            f"callable lr_scheduler")
    if len(built_on.param_groups) != len(engine_optimizer.param_groups):
        raise InitializeArgumentError(
            f"initialize(lr_scheduler=...) got a scheduler built on an optimizer with "
            f"{len(built_on.param_groups)} parameter groups, and the engine's has "
            f"{len(engine_optimizer.param_groups)}: which group's schedule is which is unknown; pass a callable "
            f"lr_scheduler (it is called with the engine's optimizer)")
    _track_optimizer_steps(engine_optimizer)
    cycles_momentum = bool(getattr(scheduler, "cycle_momentum", False))
    for theirs, group in zip(built_on.param_groups, engine_optimizer.param_groups):
        scheduled = {key for key in theirs if key != "params" and key not in built_on.defaults}
        scheduled.add("lr")
        if cycles_momentum:
            scheduled.update(key for key in _MOMENTUM_KEYS if key in theirs and key in group)
        for key in scheduled:
            group[key] = theirs[key]
    scheduler.optimizer = engine_optimizer
    return scheduler


def _track_optimizer_steps(optimizer: Optimizer) -> None:
    """Let torch's schedulers see the engine optimizer's steps, as a scheduler built on it would: torch
    wraps an optimizer's ``step`` when the first scheduler is built on it (to warn about a scheduler
    stepped before its optimizer).  A scheduler built and dropped at once does that wrapping through
    torch's public API; it sets each group's ``lr`` to its ``initial_lr``, which the caller then sets
    from the moved scheduler."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    LambdaLR(optimizer, lambda _: 1.0)
