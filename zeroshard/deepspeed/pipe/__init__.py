"""``zeroshard.deepspeed.pipe`` (DeepSpeed's ``deepspeed.pipe``): pipeline parallelism, each stage trained
with ZeRO over its data-parallel ranks (zeroshard/pipeline/, docs/PIPELINE.md)."""

from ...pipeline import LayerSpec, PipeDataParallelTopology, PipeModelDataParallelTopology, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology"]
