"""``zeroshard.deepspeed.moe.layer.MoE`` (DeepSpeed's ``deepspeed.moe.layer.MoE``): see experts/layer.py."""

from ...experts.layer import MoE

__all__ = ["MoE"]
