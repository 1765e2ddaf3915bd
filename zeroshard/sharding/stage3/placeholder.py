"""What a model shows in place of a released stage-3 parameter: full shape, no values, a clear error.

[Note: reading a sharded parameter outside forward]
DeepSpeed users meet zero-size tensors when they touch a ZeRO-3 parameter outside forward (embedding
resize, custom init, generation) and get silent nonsense.  zeroshard chose the other way round: while
a unit is released, its module attributes hold a :class:`ShardedParameterPlaceholder` on the meta
device with the parameter's full shape, dtype and ``requires_grad``; asking for values (any torch
operation) raises an error that names the parameter and says to use ``zeroshard.GatheredParameters``.
Inside that block (and during forward and backward) the real parameter is back in its module.
A read never gathers on its own: a gather is a collective, and a read that one rank alone makes
(``if rank == 0: print(w.sum())``) would wait for the others forever.  Parameters built under
``zeroshard.Init`` follow the same rule before ``initialize()`` (see [Note: what an Init-built
parameter does with each operation] in sharding/stage3/init_param.py).

[Note: operations a placeholder answers without its values]
Trainers walk a whole model with operations that read no values: Lightning's strategies take
``module.state_dict()`` (``detach()`` on every parameter) and drop the parameters' entries when the
engine writes the checkpoint itself, and move the module to the CPU when training ends
(``module.cpu()``: ``.cpu()`` / ``.to(device)`` and then ``param.data = result``).  ``detach()`` and
a device move answer the placeholder itself: it still holds no values and any read still raises,
naming the parameter; the values stay in the engine's shards, on the device the engine computes on.
A move that changes the dtype would change values, and is refused like a read.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..storage import HOMES
from .param_status import PartitionedStorage, ZeroParamStatus

#: placeholder -> the name, compute device and index (in its storage) of the parameter it stands for
_SHOWN_AS: WeakIdKeyDictionary = WeakIdKeyDictionary()

_METADATA_PROPERTIES = ("shape", "dtype", "requires_grad", "ndim", "is_leaf", "grad", "grad_fn", "layout", "itemsize",
                        "is_sparse", "is_quantized", "is_nested")

#: ``tensor.is_meta``: False, as ``tensor.device`` reports the compute device.  torch's
#: ``load_state_dict`` skips a meta parameter with only a warning: a parameter whose values are
#: elsewhere must take the copy (and land it, or raise), never be skipped.
IS_META_GETTER = getattr(torch.Tensor.is_meta, "__get__")

#: torch functions that only read a tensor's metadata: allowed on parameters whose values are elsewhere
METADATA_FUNCTIONS = frozenset(
    {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.__repr__,
     torch.Tensor.__format__, torch.Tensor.__hash__, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
     torch.Tensor.element_size, torch._has_compatible_shallow_copy_type}
    | {getattr(torch.Tensor, name).__get__ for name in _METADATA_PROPERTIES}
)

#: ``tensor.device``: a parameter whose values are elsewhere reports the device it computes on (Hugging
#: Face's ``model.device``, and code that builds new tensors "next to" a parameter, rely on it), as a
#: DeepSpeed stage-3 parameter reports its accelerator although its own data is empty.
DEVICE_GETTER = getattr(torch.Tensor.device, "__get__")  # typeshed does not describe the descriptor


#: ``param.data = value``: allowed only with the placeholder itself (what ``module.cpu()`` writes back)
DATA_SETTER = getattr(torch.Tensor.data, "__set__")


def _answers_itself(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` is ``detach()``, a move that keeps the dtype, or ``.data = `` the placeholder itself."""
    if func is torch.Tensor.detach or func is torch.Tensor.cpu:
        return True
    if func == DATA_SETTER:
        return len(args) == 2 and args[1] is args[0]
    if func is torch.Tensor.to:
        _, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        return dtype is None or dtype == args[0].dtype
    return False


class ShardedParameterError(RuntimeError):
    """The values of a sharded parameter were asked for where they are not on this rank: outside
    ``GatheredParameters`` (see [Note: reading a sharded parameter outside forward])."""


class ShardedParameterPlaceholder(nn.Parameter):
    """A released stage-3 parameter, as its module shows it outside forward."""

    @staticmethod
    def create(real: nn.Parameter, name: str = "a parameter", index: int = -1) -> "ShardedParameterPlaceholder":
        meta = torch.empty(real.shape, dtype=real.dtype, device="meta")
        holder = ShardedParameterPlaceholder(meta, requires_grad=real.requires_grad)
        _SHOWN_AS[holder] = (name, real.device, index)
        return holder

    # DeepSpeed's ZeRO-3 attributes ([Note: DeepSpeed's parameter attributes on zeroshard's own types] in
    # sharding/stage3/param_status.py)
    @property
    def ds_id(self) -> int:
        """The parameter's index in its engine's parameter list (unique within the engine)."""
        return int(_SHOWN_AS[self][2])

    @property
    def ds_numel(self) -> int:
        return self.numel()

    @property
    def ds_shape(self) -> torch.Size:
        return self.shape

    @property
    def ds_persist(self) -> bool:
        """False: a parameter kept whole on every rank (``stage3_param_persistence_threshold``) is never
        released, so its module never shows a placeholder."""
        return False

    @property
    def ds_status(self) -> ZeroParamStatus:
        storage, bucket = self._storage()
        return storage.partition_status(bucket)

    @property
    def ds_tensor(self) -> torch.Tensor:
        """This rank's elements of the parameter, 1D (a view of its chunk: writes land in the shard)."""
        storage, bucket = self._storage()
        return storage.own_part(bucket, self.ds_id)

    def partition_numel(self) -> int:
        """How many of the parameter's elements this rank holds (DeepSpeed's method of the same name)."""
        return int(self.ds_tensor.numel())

    def _storage(self) -> tuple[PartitionedStorage, int]:
        home = HOMES.home_of(self)
        if home is None:
            raise AttributeError(f"{_SHOWN_AS[self][0]!r} is no longer held by a zeroshard engine (it was closed)")
        return cast(PartitionedStorage, home.storage), home.bucket

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True) -> "ShardedParameterPlaceholder":
        return cast("ShardedParameterPlaceholder", torch.Tensor._make_subclass(cls, data, requires_grad))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.__repr__:  # "Parameter containing:" + this
            name = _SHOWN_AS[args[0]][0] if args[0] in _SHOWN_AS else "?"
            return f"ShardedParameterPlaceholder({name}, shape={tuple(args[0].shape)})"
        if func in METADATA_FUNCTIONS:
            return super().__torch_function__(func, types, args, kwargs or {})
        if func == DEVICE_GETTER:
            return _SHOWN_AS[args[0]][1]
        if func == IS_META_GETTER:
            return False
        if _answers_itself(func, args, kwargs or {}):  # see [Note: operations a placeholder answers without its values]
            return None if func == DATA_SETTER else args[0]
        name = next((_SHOWN_AS[a][0] for a in args if isinstance(a, cls) and a in _SHOWN_AS), "a parameter")
        raise ShardedParameterError(
            f"{name!r} is sharded by zeroshard stage 3 and is not gathered now; read or change it inside "
            f"`with zeroshard.GatheredParameters(...)`, or use engine.full_state_dict()"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError("a sharded zeroshard parameter cannot be pickled; use engine.full_state_dict()")
