"""``zeroshard.deepspeed.pipe`` (DeepSpeed's ``deepspeed.pipe``): pipeline parallelism is refused, with the reason."""

from ..refused import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]
