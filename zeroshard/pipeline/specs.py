"""How a pipelined model names its layers before any is built: ``LayerSpec`` and ``TiedLayerSpec``.

A spec holds a layer's class and arguments; only the stage that owns the layer builds it, so no rank
ever holds the whole model.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn


class LayerSpec:
    """``LayerSpec(typename, *args, **kwargs)``: the layer ``typename(*args, **kwargs)``, built on its stage."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not isinstance(typename, type) or not issubclass(typename, nn.Module):
            raise TypeError(f"LayerSpec needs an nn.Module class, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose weight (``tied_weight_attr``) is one tensor on every stage that uses ``key``: the
    first use builds the module, later uses of the key on the same stage call the same module (through
    ``forward_fn(module, inputs)`` when given); across stages the weight stays identical and its
    gradient is the sum over every use (see [Note: tied weights across stages] in pipeline/tied.py)."""

    def __init__(self, key: str, typename: type, *module_args: Any,
                 forward_fn: Optional[Callable[[nn.Module, Any], Any]] = None,
                 tied_weight_attr: str = "weight", **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = tied_weight_attr

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"
