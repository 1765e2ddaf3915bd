"""``deepspeed.module_inject``: the module path of AutoTP's shard sizes (tp_shard.py); zeroshard's
tensor parallelism is zeroshard/tensor_parallel/."""

from . import tp_shard

__all__ = ["tp_shard"]
