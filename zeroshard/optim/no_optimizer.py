"""The optimizer of an engine built without one: forward passes only.

[Note: an engine without an optimizer]
``initialize(model=..., config=...)`` with neither ``optimizer=`` nor an ``optimizer`` block builds an
engine that runs forward passes: evaluation and inference, at ZeRO stage 3 over sharded parameters,
as DeepSpeed does (Hugging Face's Trainer initializes one this way to evaluate or predict without
training).  Its ``backward()`` and ``step()`` raise :class:`NoOptimizerError` on every rank before any
collective, rather than reducing gradients nothing will apply.  Stages 1 and 2 shard the optimizer's
state and the gradients, so without an optimizer they have nothing to do and are refused, as in
DeepSpeed; stage 0 and stage 3 are not.  The engine's storage is the training engine's (stage 3 keeps
its fp32 shards under mixed precision): the savings of a storage for inference alone are not taken.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch


class NoOptimizerError(RuntimeError):
    """A call that trains on an engine built without an optimizer (see [Note: an engine without an
    optimizer])."""


def no_optimizer_error(call: str) -> NoOptimizerError:
    return NoOptimizerError(f"{call}: the engine was initialize()d without an optimizer, so it runs forward passes "
                            f"only (evaluation, inference); pass optimizer= or add an 'optimizer' block to the "
                            f"config to train")


class NoOptimizer(torch.optim.Optimizer):
    """The engine's optimizer when none was given: it holds the parameter groups (so that checkpoints
    and ``get_lr()`` read them as any optimizer's) and refuses to step."""

    def __init__(self, groups: Iterable[dict[str, Any]]) -> None:
        super().__init__(list(groups), {"lr": 0.0})

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        raise no_optimizer_error("step()")
