"""``zeroshard.pipe`` (DeepSpeed's ``deepspeed.pipe``): pipeline parallelism is refused, with the reason."""

from ..compat.refused import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]
