"""Mixed precision: which dtype each piece of training state has, and fp16 loss scaling.

The fp32 master weights live with the sharding (zeroshard/sharding/master_weights.py): which part of
them a rank holds is a question of ownership."""

from .loss_scaler import LossScaleError, LossScaler
from .policy import DTYPES, PrecisionPolicy

__all__ = ["DTYPES", "PrecisionPolicy", "LossScaler", "LossScaleError"]
