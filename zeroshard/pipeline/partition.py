"""Which layers each pipeline stage holds: ``partition_method`` "parameters", "uniform" or "type:<regex>".

Every method gives each layer a weight and cuts the sequence into ``num_stages`` contiguous, non-empty
runs whose heaviest run is as light as possible (ties go to the earliest cut, so every rank computes
the same split).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch
from torch import nn

from .specs import LayerSpec


class TooFewLayersError(ValueError):
    """Fewer layers than pipeline stages: some stage would hold nothing."""


class PartitionMethodError(ValueError):
    """A ``partition_method`` zeroshard does not know."""


def layer_weights(layers: Sequence[Any], method: str) -> list[int]:
    """One weight per layer for ``method``."""
    if method == "uniform":
        return [1] * len(layers)
    if method == "parameters":
        return [_parameter_count(layer) for layer in layers]
    if method.startswith("type:"):
        pattern = re.compile(method[len("type:"):], re.IGNORECASE)
        return [1 if pattern.search(_type_name(layer)) else 0 for layer in layers]
    raise PartitionMethodError(f"partition_method={method!r}: use 'parameters', 'uniform' or 'type:<regex>'")


def _type_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__ if isinstance(layer, nn.Module) else getattr(layer, "__name__", type(layer).__name__)


def _parameter_count(layer: Any) -> int:
    """Trainable elements of a layer; a spec is built on the meta device, which allocates nothing."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def balanced_bounds(weights: Sequence[int], parts: int) -> list[int]:
    """``parts + 1`` boundaries: part ``i`` holds items ``bounds[i]:bounds[i+1]``, the heaviest part as
    light as possible.  With at least ``parts`` items none is empty; with fewer, each item is a part of
    its own and the last parts are empty (as DeepSpeed's ``partition_balanced`` answers: a stage needs
    a layer, so :func:`partition` refuses that case before it gets here)."""
    n = len(weights)
    if parts < 1:
        raise ValueError(f"{parts} parts: a partition needs at least one part")
    if n < parts:
        return [min(p, n) for p in range(parts + 1)]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the lightest heaviest part when the first i layers go into k parts; cut[k][i] where
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def partition(layers: Sequence[Any], parts: int, method: str) -> list[int]:
    """The boundaries of ``parts`` stages over ``layers`` by ``method``."""
    if len(layers) < parts:
        raise TooFewLayersError(f"{len(layers)} layer(s) for {parts} pipeline stages: every stage needs at least "
                                f"one layer; use fewer stages or split the model into more layers")
    return balanced_bounds(layer_weights(layers, method.lower() if not method.startswith("type:") else method),
                           parts)
