"""What FP8 layers do not compose with, refused by name on every rank before anything is built."""

from __future__ import annotations

from ..errors import refuse

__all__ = ["refuse_fp8_with"]


def refuse_fp8_with(tensor_parallel: int, pipeline: bool) -> None:
    """Refuse FP8 beside tensor parallelism (its layers are split linears that torchao's layer is not) or a
    pipeline (its stages are built and sharded apart from ``initialize()``'s conversion)."""
    if tensor_parallel > 1:
        refuse("'fp8.enabled' with tensor parallelism", f"the tensor-parallel degree is {tensor_parallel}, and the "
               "split linear layers are not FP8 layers", "Turn 'fp8.enabled' off, or train without tensor "
               "parallelism.")
    if pipeline:
        refuse("'fp8.enabled' with a PipelineModule (pipeline parallelism)", "the pipeline's stages are not "
               "converted to FP8 layers", "Turn 'fp8.enabled' off, or train without a pipeline.")
