"""``zeroshard.deepspeed.ops`` (DeepSpeed's ``deepspeed.ops``): optimizers under DeepSpeed's names, and
DeepSpeed's op builders (:mod:`.op_builder`); ``__compatible_ops__`` answers as their ``is_compatible()``."""

from . import adam, op_builder

__all__ = ["adam", "op_builder", "__compatible_ops__"]

#: each op's NAME -> whether zeroshard provides what it is for (see op_builder.py)
__compatible_ops__ = op_builder.compatible_ops()
