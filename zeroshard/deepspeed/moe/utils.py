"""``zeroshard.deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer``.

DeepSpeed scripts pass their optimizer groups through it unconditionally; it splits expert-parallel
parameters into groups of their own.  zeroshard has no MoE layers, so no parameter is an expert's
and the groups come back as they went in.  A parameter marked as an expert's (DeepSpeed's
``allreduce=False`` attribute) is refused: it would need expert parallelism.
"""

from __future__ import annotations

from typing import Any, Union


def split_params_into_different_moe_groups_for_optimizer(param_groups: Union[dict, list, tuple],
                                                         max_group_size: Any = None) -> list[dict]:
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    for group in groups:
        for p in group["params"]:
            if getattr(p, "allreduce", True) is False:
                raise ValueError("an expert (MoE) parameter was found: zeroshard has no expert parallelism")
    return groups
