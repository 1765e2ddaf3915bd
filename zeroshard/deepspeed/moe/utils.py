"""``zeroshard.deepspeed.moe.utils``: DeepSpeed's ``is_moe_param`` and
``split_params_into_different_moe_groups_for_optimizer``.

DeepSpeed scripts pass their optimizer groups through the split unconditionally.  Expert parameters
(those of a zeroshard ``MoE`` layer, see [Note: experts are known by identity, not by attribute] in
experts/registry.py) go into groups of their own, one per original group and expert group, marked
``"moe": True`` and named by the expert group, as in DeepSpeed; with expert-parallel size 1 the engine
trains those groups like any other.  A parameter that another MoE implementation marked as an expert's
(DeepSpeed's ``allreduce=False`` attribute) is refused: its layer would need expert parallelism.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ...experts.registry import expert_group_name

#: DeepSpeed's default cap on the elements of one expert group
MAX_GROUP_SIZE = 178956971


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert's: of a zeroshard MoE layer, or marked by DeepSpeed's attribute."""
    return expert_group_name(param) is not None or getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(param_groups: Union[dict, list, tuple],
                                                         max_group_size: Optional[Any] = MAX_GROUP_SIZE
                                                         ) -> list[dict]:
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(f"unknown param group type {type(param_groups).__name__}")
    expert_groups: list[dict[str, dict[str, Any]]] = []
    for group in groups:
        by_name: dict[str, dict[str, Any]] = {}
        dense = []
        for p in group["params"]:
            name = _expert_group(p)
            if name is None:
                dense.append(p)
                continue
            by_name.setdefault(name, {**group, "name": name, "moe": True, "params": []})["params"].append(p)
        group["params"] = dense
        expert_groups.append(by_name)
    for by_name in expert_groups:
        for expert_group in by_name.values():
            groups.extend(_capped(expert_group, max_group_size))
    return groups


def _expert_group(param: torch.Tensor) -> Optional[str]:
    name = expert_group_name(param)
    if name is None and getattr(param, "allreduce", True) is False:
        raise ValueError("a parameter marked as an expert's (allreduce=False) that no zeroshard MoE layer built "
                         "was found: its layer would need expert parallelism, which zeroshard does not have")
    return name


def _capped(group: dict[str, Any], max_group_size: Optional[Any]) -> list[dict[str, Any]]:
    """``group`` cut into groups of at most ``max_group_size`` elements each (a larger parameter alone)."""
    if max_group_size is None:
        return [group]
    parts: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in group["params"]:
        numel = int(getattr(p, "ds_numel", p.numel()))
        if parts[-1] and size + numel > max_group_size:
            parts.append([])
            size = 0
        parts[-1].append(p)
        size += numel
    return [{**group, "params": part} for part in parts if part]
