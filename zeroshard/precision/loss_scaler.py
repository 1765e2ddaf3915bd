"""Loss scaling for fp16: keep small gradients representable, skip the steps whose gradients overflow.

[Note: dynamic loss scaling]
The loss is multiplied by ``scale`` before backward, so every gradient is ``scale`` times too large,
and divided back (in fp32, on the master side) before the optimizer sees it.  If any gradient on
any rank is inf or NaN, the global gradient norm (summed across ranks) is inf or NaN on *every* rank,
so all ranks skip the same step: parameters, optimizer state and the LR schedule stay untouched.

On an overflow the scale is halved, unless ``hysteresis`` still has overflows to absorb (each one
uses one up).  After ``loss_scale_window`` steps in a row without overflow the scale doubles and
the hysteresis is refilled (with ``consecutive_hysteresis`` it is refilled after every clean step).
An overflow when the scale is already at ``min_loss_scale`` (hysteresis used up) raises
:class:`LossScaleError`: the run has diverged or the model does not fit fp16, and halving further
would only loop.  A static scale (``loss_scale`` > 0) never changes; its overflowing steps are
still skipped.  bf16 and fp32 train with a scale of 1 and no overflow check.
"""

from __future__ import annotations

from typing import Any

from ..config import ZeroshardConfig


class LossScaleError(RuntimeError):
    """Gradients keep overflowing at the minimum loss scale."""


class LossScaler:
    """The loss scale and its update rule (see [Note: dynamic loss scaling])."""

    def __init__(self, scale: float = 1.0, dynamic: bool = False, checks_overflow: bool = False,
                 window: int = 1000, hysteresis: int = 2, consecutive_hysteresis: bool = False,
                 min_scale: float = 1.0) -> None:
        self.scale = float(scale)
        self.dynamic = dynamic
        self.checks_overflow = checks_overflow
        self.window = window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.hysteresis_left = hysteresis
        self.clean_steps = 0  # steps without overflow since the last overflow or growth

    @classmethod
    def from_config(cls, config: ZeroshardConfig) -> "LossScaler":
        fp16 = config.fp16
        if not fp16.enabled:
            return cls()
        if fp16.loss_scale > 0:
            return cls(scale=fp16.loss_scale, checks_overflow=True)
        return cls(scale=2.0 ** fp16.initial_scale_power, dynamic=True, checks_overflow=True,
                   window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                   consecutive_hysteresis=fp16.consecutive_hysteresis, min_scale=fp16.min_loss_scale)

    def update(self, overflow: bool, step: int) -> None:
        """Account for one optimizer step (``step``: its number, for the error message)."""
        if not self.dynamic:
            return
        if overflow:
            self.clean_steps = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
                return
            if self.scale <= self.min_scale:
                raise LossScaleError(
                    f"step {step}: gradients overflowed again at the minimum loss scale {self.min_scale:g} "
                    f"(fp16.min_loss_scale); the loss has probably diverged (inf/NaN in the forward pass) "
                    f"or the model's values do not fit fp16: lower the learning rate, check the data, or "
                    f"train with bf16")
            self.scale = max(self.scale / 2, self.min_scale)
            return
        self.clean_steps += 1
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.clean_steps % self.window == 0:
            self.scale *= 2
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "dynamic": self.dynamic, "hysteresis_left": self.hysteresis_left,
                "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.clean_steps = int(state["clean_steps"])
