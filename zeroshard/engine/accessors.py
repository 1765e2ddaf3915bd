"""The engine's DeepSpeed-style accessors: plain reads of its config, optimizer and counters.

[Note: the accessors as a base of the engine]
DeepSpeed's scripts call these on the engine itself (``engine.get_lr()``, ``engine.train_batch_size()``),
so they are the engine's own methods; they read what the engine already holds and decide nothing, and
keeping them in a base class leaves engine.py to the wiring of forward, backward and step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypeVar

from torch import nn

if TYPE_CHECKING:
    from ..config import ZeroshardConfig
    from ..sharding.strategy import ShardingStrategy
    from .optimizer_step import OptimizerStep

Self = TypeVar("Self", bound="EngineAccessors")


class EngineAccessors:
    """What DeepSpeed's engine answers about itself, read from the engine's parts."""

    module: nn.Module
    optimizer: Any
    optimizer_step: "OptimizerStep"
    config: "ZeroshardConfig"
    strategy: "ShardingStrategy"

    def train(self: Self, mode: bool = True) -> Self:
        self.module.train(mode)
        return self

    def eval(self: Self) -> Self:
        self.module.eval()
        return self

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        """The gradient norm of the last optimizer step, before clipping (same on every rank)."""
        return self.optimizer_step.grad_norm

    def train_batch_size(self) -> int:
        assert self.config.train_batch_size is not None
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        assert self.config.train_micro_batch_size_per_gpu is not None
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        assert self.config.gradient_accumulation_steps is not None
        return self.config.gradient_accumulation_steps

    @property
    def stage(self) -> int:
        return self.strategy.stage
