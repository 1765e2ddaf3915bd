"""Which parameters belong to an MoE layer's experts, and the name of their optimizer group.

[Note: experts are known by identity, not by attribute]
DeepSpeed marks an expert parameter by setting ``allreduce = False`` and ``group_name`` on the tensor.
zeroshard sets nothing on a user's tensors: the experts an :class:`~zeroshard.experts.layer.MoE` builds
are remembered here, by identity and weakly, so a parameter that is dropped is forgotten with it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

#: the expert group every expert belongs to: DeepSpeed's name for expert-parallel size 1
EXPERT_GROUP_NAME = "ep_size_1"

_EXPERT_GROUP: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_expert_params(module: torch.nn.Module, group_name: str = EXPERT_GROUP_NAME) -> None:
    """Remember every parameter of ``module`` as an expert's, in ``group_name``."""
    for p in module.parameters():
        _EXPERT_GROUP[p] = group_name


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to the experts of a zeroshard MoE layer."""
    return param in _EXPERT_GROUP


def expert_group_name(param: torch.Tensor) -> Optional[str]:
    """The expert group of an expert parameter; None for any other tensor."""
    return _EXPERT_GROUP.get(param)
