"""What a model shows in place of a released stage-3 parameter: full shape, no values, a clear error.

[Note: reading a sharded parameter outside forward]
DeepSpeed users meet zero-size tensors when they touch a ZeRO-3 parameter outside forward (embedding
resize, custom init, generation) and get silent nonsense.  zeroshard chose the other way round: while
a unit is released, its module attributes hold a :class:`ShardedParameterPlaceholder` on the meta
device with the parameter's full shape, dtype and ``requires_grad``; asking for values (any torch
operation) raises an error that names the parameter and says to use ``zeroshard.GatheredParameters``.
Inside that block (and during forward and backward) the real parameter is back in its module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_METADATA_PROPERTIES = ("shape", "dtype", "requires_grad", "ndim", "is_leaf", "grad", "layout", "is_meta",
                        "itemsize")

#: torch functions that only read a tensor's metadata: allowed on parameters whose values are elsewhere
METADATA_FUNCTIONS = frozenset(
    {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.__repr__,
     torch.Tensor.__format__, torch.Tensor.__hash__, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
     torch.Tensor.element_size}
    | {getattr(torch.Tensor, name).__get__ for name in _METADATA_PROPERTIES}
)

#: ``tensor.device``: a parameter whose values are elsewhere reports the device it computes on (Hugging
#: Face's ``model.device``, and code that builds new tensors "next to" a parameter, rely on it), as a
#: DeepSpeed stage-3 parameter reports its accelerator although its own data is empty.
DEVICE_GETTER = torch.Tensor.device.__get__  # type: ignore[attr-defined]


class ShardedParameterPlaceholder(nn.Parameter):
    """A released stage-3 parameter, as its module shows it outside forward."""

    @staticmethod
    def create(real: nn.Parameter, name: str) -> "ShardedParameterPlaceholder":
        meta = torch.empty(real.shape, dtype=real.dtype, device="meta")
        holder = ShardedParameterPlaceholder(meta, requires_grad=real.requires_grad)
        holder._zeroshard_home = real._zeroshard_home  # type: ignore[attr-defined]
        holder._zeroshard_name = name  # type: ignore[attr-defined]
        holder._zeroshard_device = real.device  # type: ignore[attr-defined]
        return holder

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True) -> "ShardedParameterPlaceholder":
        return torch.Tensor._make_subclass(cls, data, requires_grad)  # type: ignore[return-value]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in METADATA_FUNCTIONS:
            return super().__torch_function__(func, types, args, kwargs or {})
        if func == DEVICE_GETTER:
            return args[0]._zeroshard_device
        name = next((getattr(a, "_zeroshard_name", None) for a in args if isinstance(a, cls)), "a parameter")
        raise RuntimeError(
            f"{name!r} is sharded by zeroshard stage 3 and is not gathered now; read or change it inside "
            f"`with zeroshard.GatheredParameters(...)`, or use engine.full_state_dict()"
        )

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"ShardedParameterPlaceholder({getattr(self, '_zeroshard_name', '?')}, shape={tuple(self.shape)})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError("a sharded zeroshard parameter cannot be pickled; use engine.full_state_dict()")
