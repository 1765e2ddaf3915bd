"""The precision plugin of :class:`~zeroshard.lightning.ZeroshardStrategy`: the engine runs backward
and the optimizer step, and the config carries the precision."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities import apply_to_collection
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import Optimizer

import lightning.pytorch as pl

from ..engine.engine import Engine

__all__ = ["ZeroshardPrecision", "PRECISION_CONFIG"]

#: the dtype floating-point inputs are handed to the model in, by precision flag (fp32: as they come)
_INPUT_DTYPE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}

#: Lightning's precision flags zeroshard trains in, and the config block each one is
PRECISION_CONFIG: dict[str, dict[str, Any]] = {
    "32-true": {},
    "bf16-mixed": {"bf16": {"enabled": True}},
    "16-mixed": {"fp16": {"enabled": True}},
}


class ZeroshardPrecision(Precision):
    """Lightning's precision flag as zeroshard's config block; backward and step through the engine.

    [Note: Lightning's loss is already divided]
    Lightning divides each micro batch's loss by ``accumulate_grad_batches`` before it hands it to
    backward, as DDP needs.  The engine's ``backward`` would divide it again (DeepSpeed's
    ``scale_wrt_gas``), so this plugin calls it with ``scale_wrt_gas=False``: the gradient summed over
    an accumulation window is then the mean over its samples, as under Lightning's DDP strategy.
    """

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in PRECISION_CONFIG:
            raise ValueError(f"Trainer(strategy='zeroshard...', precision={precision!r}) is not supported; choose "
                             f"one of {', '.join(PRECISION_CONFIG)} (zeroshard keeps fp32 masters under mixed "
                             f"precision)")
        self.precision = precision  # type: ignore[assignment]

    @property
    def config(self) -> dict[str, Any]:
        """This precision's block of the engine's config."""
        return dict(PRECISION_CONFIG[str(self.precision)])

    def convert_input(self, data: Any) -> Any:
        """Floating-point tensors of the batch, at any depth, in the 16-bit dtype the weights compute in
        (as Lightning's DeepSpeed plugin hands them to DeepSpeed's engine)."""
        dtype = _INPUT_DTYPE.get(str(self.precision))
        if dtype is None:
            return data
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def backward(self, tensor: torch.Tensor, model: "pl.LightningModule", optimizer: Any,  # type: ignore[override]
                 *args: Any, **kwargs: Any) -> None:
        """The engine's backward of Lightning's already divided loss ([Note: Lightning's loss is already
        divided])."""
        _engine_of(model).backward(tensor, scale_wrt_gas=False)

    def optimizer_step(self, optimizer: Any, model: "pl.LightningModule",  # type: ignore[override]
                       closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure (forward and backward), then the engine's step, which steps the optimizer at
        the accumulation boundary only."""
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise MisconfigurationException("Skipping backward by returning None from training_step is not supported "
                                            "with zeroshard: every rank must run the same backward")
        _engine_of(model).step()
        return result

    def clip_gradients(self, optimizer: Optimizer, clip_val: Union[int, float] = 0.0,
                       gradient_clip_algorithm: Optional[GradClipAlgorithmType] = GradClipAlgorithmType.NORM) -> None:
        """Nothing here: the engine clips the global norm at its step (``gradient_clipping``, which the
        strategy sets from ``Trainer(gradient_clip_val=...)``)."""


def _engine_of(model: "pl.LightningModule") -> Engine:
    """The engine the strategy wrapped ``model`` in."""
    engine = getattr(model.trainer.strategy, "engine", None)
    if not isinstance(engine, Engine):
        raise MisconfigurationException("ZeroshardPrecision runs with ZeroshardStrategy only")
    return engine
