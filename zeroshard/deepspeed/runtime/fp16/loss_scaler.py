"""``deepspeed.runtime.fp16.loss_scaler``: the names DeepSpeed's checkpoint files pickle its loss scalers
by, so that a script which unpickles them itself (DeepSpeed's own ``zero_to_fp32.py``, kept beside its
checkpoints) finds them under ``install_as_deepspeed()``: records of the saved values, no behaviour
(see [Note: DeepSpeed's pickles read as data] in checkpoint/deepspeed_format/unpickle.py).  zeroshard's
own loss scaling is ``zeroshard.precision``'s."""

from __future__ import annotations

from ....checkpoint.deepspeed_format.unpickle import DynamicLossScaler, LossScaler

__all__ = ["LossScaler", "DynamicLossScaler"]
