"""``zeroshard.deepspeed.ops`` (DeepSpeed's ``deepspeed.ops``): optimizers under DeepSpeed's names."""

from . import adam

__all__ = ["adam"]
