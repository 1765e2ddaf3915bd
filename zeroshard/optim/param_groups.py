"""Which parameters zeroshard trains, under which names, in which optimizer group.

The truth comes from, in order: an optimizer instance passed to ``initialize`` (its param_groups),
``model_parameters`` (tensors or DeepSpeed-style group dicts), or ``model.parameters()``.  Parameters
that do not require grad are frozen: never sharded, never communicated, never updated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import torch
from torch import nn


@dataclass
class TrainableParams:
    """The trainable parameters in model order, their names, group index, and each group's options."""

    params: list[nn.Parameter]
    names: list[str]
    group_of: list[int]
    group_options: list[dict[str, Any]]
    frozen: list[nn.Parameter]


def collect_trainable(model: nn.Module, model_parameters: Optional[Iterable[Any]] = None,
                      optimizer: Optional[torch.optim.Optimizer] = None,
                      replaced: Optional[Mapping[int, nn.Parameter]] = None) -> TrainableParams:
    """``replaced``: parameters the model no longer holds (built under ``zeroshard.Init``, swapped at
    initialize()) -> the ones it holds now; groups naming the old ones mean the new ones."""
    named = list(model.named_parameters())  # de-duplicated: a tied weight appears once
    name_of = {id(p): n for n, p in named}
    groups = _groups(model, model_parameters, optimizer)
    group_index: dict[int, int] = {}
    options: list[dict[str, Any]] = []
    for gi, group in enumerate(groups):
        options.append({k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            p = (replaced or {}).get(id(p), p)
            if id(p) not in name_of:
                raise ValueError("model_parameters holds a tensor that is not a parameter of the model")
            group_index.setdefault(id(p), gi)
    params, names, group_of, frozen = [], [], [], []
    for name, p in named:
        if not p.requires_grad:
            frozen.append(p)
            continue
        if id(p) not in group_index:
            raise ValueError(f"parameter {name!r} requires grad but is not in model_parameters (or the "
                             f"optimizer's groups); include it, or freeze it with requires_grad_(False)")
        params.append(p)
        names.append(name)
        group_of.append(group_index[id(p)])
    if not params:
        raise ValueError("the model has no parameter that requires grad: there is nothing to train")
    return TrainableParams(params, names, group_of, options, frozen)


def _groups(model: nn.Module, model_parameters: Optional[Iterable[Any]],
            optimizer: Optional[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    if optimizer is not None:
        return [dict(g) for g in optimizer.param_groups]
    if model_parameters is None:
        return [{"params": list(model.parameters())}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [{**g, "params": list(g["params"])} for g in items]
    return [{"params": items}]
