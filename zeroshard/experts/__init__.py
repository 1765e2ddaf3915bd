"""Mixture-of-experts layers (DeepSpeed's ``deepspeed.moe.layer.MoE``) with every expert on every rank.

The experts are ordinary parameters of the model, replicated across data-parallel ranks and sharded by
ZeRO like any other; routing is per rank, on that rank's tokens (see [Note: experts are data parallel]
in experts/layer.py).
"""

from .gating import Routing, TopKGate, top1_routing, top2_routing
from .layer import MoE, MoENotSupported
from .registry import EXPERT_GROUP_NAME, expert_group_name, is_expert_param

__all__ = ["MoE", "MoENotSupported", "TopKGate", "Routing", "top1_routing", "top2_routing", "is_expert_param",
           "expert_group_name", "EXPERT_GROUP_NAME"]
