"""The engine's optimizer over the updater's pieces, and its learning-rate schedule, from what
``initialize()`` was given (an optimizer object, a callable, the config's blocks, or nothing)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ..errors import InitializeArgumentError
from ..optim import build_scheduler, from_config, from_user
from ..optim.no_optimizer import NoOptimizer
from ..optim.scheduler_rebinding import rebind_scheduler

if TYPE_CHECKING:
    from ..config import ZeroshardConfig
    from ..offload.policy import OffloadPolicies
    from ..sharding.strategy import StageTraits

SchedulerSpec = Union[None, LRScheduler, Callable[[Optimizer], LRScheduler]]


def optimizer_over_pieces(optimizer: Any, groups: list[dict[str, Any]], config: "ZeroshardConfig",
                          traits: "StageTraits", offload: "OffloadPolicies") -> Optimizer:
    """The optimizer over ``groups`` (the parameter groups of the updater's pieces): the user's object
    with its tensors swapped, one built by the user's callable or from the config, or :class:`NoOptimizer`."""
    if isinstance(optimizer, Optimizer):
        # Keep the user's object (a scheduler may already hold it): swap its tensors for our chunks.
        if any(len(s) for s in optimizer.state.values()):
            raise ValueError("initialize(optimizer=...) got an optimizer that has already stepped; "
                             "pass a fresh one so that zeroshard can rebuild it over the shards")
        for target, group in zip(optimizer.param_groups, groups):
            target["params"] = group["params"]
        optimizer.state.clear()
        return optimizer
    if optimizer is not None:
        return from_user(optimizer, groups)
    if config.optimizer is None:  # see [Note: an engine without an optimizer] in optim/no_optimizer.py
        if traits.needs_optimizer:
            raise InitializeArgumentError(
                f"ZeRO stage {traits.stage} shards the optimizer's state, and initialize() got no "
                f"optimizer: add an 'optimizer' block to the config or pass optimizer=, or use stage 0 or 3 "
                f"for an engine that runs forward passes only")
        return NoOptimizer(groups)
    return from_config(config.optimizer.type, config.optimizer.params, groups, on_host=offload.optimizer_on_host)


def lr_schedule(spec: SchedulerSpec, optimizer: Optimizer, optimizer_given: bool, config: "ZeroshardConfig",
                parameters: Iterable[nn.Parameter]) -> Optional[LRScheduler]:
    """The schedule over the engine's ``optimizer``: ``spec`` (a scheduler, or a callable that builds
    one), else the config's ``scheduler`` block; ``optimizer_given``: the user passed the optimizer."""
    if isinstance(optimizer, NoOptimizer) and (spec is not None or config.scheduler is not None):
        raise InitializeArgumentError("initialize() got a learning-rate schedule but no optimizer: add an "
                                      "'optimizer' block to the config or pass optimizer=")
    if isinstance(spec, LRScheduler):
        if spec.optimizer is optimizer:
            return spec
        if optimizer_given:
            raise InitializeArgumentError(
                "initialize(lr_scheduler=...) got a scheduler built on another optimizer than the one passed "
                "as optimizer=; build it on that optimizer, or pass a callable lr_scheduler")
        # built before the engine's optimizer existed (see [Note: a scheduler built before
        # initialize()] in optim/scheduler_rebinding.py)
        return rebind_scheduler(spec, optimizer, parameters)
    if spec is not None:
        return spec(optimizer)
    if config.scheduler is not None:
        return build_scheduler(config.scheduler.type, config.scheduler.params, optimizer)
    return None
