"""The engine of one tensor-parallel rank, at the path it had: an ordinary engine built with the tensor
axis's parts (tensor_parallel/engine.py, tensor_parallel/slices.py)."""

from ..tensor_parallel.engine import tensor_parallel_engine
from ..tensor_parallel.slices import TensorParallelCheckpointError

#: the engine of one tensor-parallel rank (a function that builds an :class:`~zeroshard.engine.Engine`)
TensorParallelEngine = tensor_parallel_engine

__all__ = ["TensorParallelCheckpointError", "TensorParallelEngine"]
