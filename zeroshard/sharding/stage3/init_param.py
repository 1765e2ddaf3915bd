"""A parameter built under ``zeroshard.Init``: full shape outside, this rank's 1/N of its elements inside.

[Note: what an Init-built parameter does with each operation]
Until ``initialize()`` takes it over, an :class:`InitShardedParameter` holds only this rank's chunk of
its padded flat values.  Every torch operation on it falls into one of five kinds, decided by
:func:`classify` and the same for every rank:

- *metadata* (shape, dtype, device, ``requires_grad_``): answered from the parameter itself;
- *views* (``.data``, ``detach()``, basic indexing, ``view``, ``t()``, ...): a lazy view of the same
  chunk, so that a write through it lands (``w.data[0:10] = v``, ``w[pad].zero_()``);
- *local writes* (``copy_``, ``fill_``, ``zero_``, item assignment, in-place arithmetic with plain
  arguments, ``nn.init`` initialisers) and *conversions* (``.to(dtype)``, ``.half()``, ``clone()``):
  computed on this rank's chunk alone, with no collective.  An elementwise write only needs the
  elements it changes, so it runs on a full-shaped scratch tensor that holds this rank's chunk in its
  place (and zeros elsewhere), and the chunk is kept.  Every rank that makes the write gets the same
  chunk it would keep of the unsharded result; ``.data = t`` of any shape keeps this rank's chunk of
  ``t`` and takes its shape;
- *reads* of the values (``sum()``, ``float()``, ``w @ x``, a copy into a plain tensor): outside the
  ``Init`` block they raise :class:`ShardedParameterError`, because the values exist only across
  ranks and gathering them is a collective that one rank alone (``if rank == 0: print(w)``) would
  wait on forever.  Inside the ``Init`` block (construction: every rank runs the same code) a read
  gathers the parameter into a temporary full tensor, and inside ``GatheredParameters`` it reads the
  gathered values, with no collective;
- anything else that would change the values in place (an operation not known to be elementwise):
  gathered and kept inside the ``Init`` block, refused outside it.

Released stage-3 parameters after ``initialize()`` follow the same rule for reads (their placeholder
raises the same error, see [Note: reading a sharded parameter outside forward] in
sharding/stage3/placeholder.py).
"""

from __future__ import annotations

from enum import Enum
import itertools
from typing import Any, Optional, Sequence, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ...distributed.collectives import Collectives
from .param_status import ZeroParamStatus
from .placeholder import DEVICE_GETTER, IS_META_GETTER, METADATA_FUNCTIONS, ShardedParameterError

#: ``ds_id`` of the parameters built under Init, in the order they are built
_NEXT_ID = itertools.count()

#: ``requires_grad_`` and ``p.requires_grad = ...`` (a model frozen under Init, as LoRA code does) change
#: the parameter itself, not its values
FLAG_FUNCTIONS = frozenset({torch.Tensor.requires_grad_, getattr(torch.Tensor.requires_grad, "__set__")})
DATA_GETTER = getattr(torch.Tensor.data, "__get__")
DATA_SETTER = getattr(torch.Tensor.data, "__set__")

#: operations whose result shares the parameter's values (torch returns a view): writes through it land
VIEW_FUNCTIONS = frozenset({
    DATA_GETTER, torch.Tensor.detach, torch.Tensor.__getitem__, torch.Tensor.view, torch.Tensor.view_as,
    torch.Tensor.narrow, torch.Tensor.select, torch.Tensor.t, torch.Tensor.transpose, torch.Tensor.permute,
    torch.Tensor.unsqueeze, torch.Tensor.squeeze, torch.Tensor.expand, torch.Tensor.unflatten,
    getattr(torch.Tensor.T, "__get__"), getattr(torch.Tensor.mT, "__get__"),
})

#: questions about how a tensor is stored, not its values (``module.to()`` asks them)
_LAYOUT_QUERIES = frozenset({torch._has_compatible_shallow_copy_type, torch.Tensor.is_contiguous})

#: views that show every element where the parameter has it
_SAME_VALUES = frozenset({DATA_GETTER, torch.Tensor.detach})

#: dtype and device conversions, and copies: computed on the chunk alone
CONVERSIONS = frozenset({torch.Tensor.to, torch.Tensor.half, torch.Tensor.float, torch.Tensor.double,
                         torch.Tensor.bfloat16, torch.Tensor.clone, torch.Tensor.contiguous, torch.Tensor.cpu,
                         torch.Tensor.type_as})


_INIT_NAMES = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
               "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
#: modules whose initialisers reach a tensor's ``__torch_function__`` under their own name (transformers
#: replaces ``torch.nn.init``'s functions with guarded ones while it initialises a model)
_INIT_MODULES = frozenset({"torch.nn.init", "transformers.initialization"})


def _overwriting_functions() -> frozenset:
    """Initialisers that overwrite every element without reading it."""
    tensor_names = ("uniform_", "normal_", "zero_", "fill_", "random_", "exponential_", "geometric_",
                    "log_normal_", "cauchy_")
    return frozenset([getattr(nn.init, n) for n in _INIT_NAMES if hasattr(nn.init, n)]
                     + [getattr(torch.Tensor, n) for n in tensor_names])


def overwrites(func: Any) -> bool:
    """Whether ``func`` writes every element of its first argument without reading any."""
    return func in OVERWRITING or (getattr(func, "__module__", None) in _INIT_MODULES
                                   and getattr(func, "__name__", None) in _INIT_NAMES)


OVERWRITING = _overwriting_functions()

#: in-place operations whose result at each element depends only on that element (and plain arguments)
ELEMENTWISE_WRITES = OVERWRITING | frozenset(
    getattr(torch.Tensor, name) for name in (
        "__setitem__", "copy_", "add_", "sub_", "mul_", "div_", "clamp_", "clamp_min_", "clamp_max_",
        "masked_fill_", "index_fill_", "fill_diagonal_", "abs_", "neg_", "sqrt_", "pow_", "exp_",
        "addcmul_", "addcdiv_", "lerp_", "__iadd__", "__isub__", "__imul__", "__itruediv__", "nan_to_num_",
        "bernoulli_", "tril_", "triu_"))


class Kind(Enum):
    METADATA = "metadata"
    VIEW = "view"
    LOCAL_WRITE = "local write"
    CONVERSION = "conversion"
    ASSIGN = "assign"  # ``.data = t``
    READ = "read"
    OTHER_WRITE = "other write"


def _is_basic_index(index: Any) -> bool:
    """Ints, slices, None and Ellipsis: indexing that returns a view (a tensor or list index copies)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)


def classify(func: Any, args: Sequence[Any], kwargs: dict) -> Kind:
    """What an operation does to the sharded parameter it was called on (see the Note above)."""
    if (func in METADATA_FUNCTIONS or func in FLAG_FUNCTIONS or func in _LAYOUT_QUERIES or func == DEVICE_GETTER
            or func == IS_META_GETTER):
        return Kind.METADATA
    target = args[0] if args else None
    sharded_target = isinstance(target, InitShardedParameter)
    others = [a for a in tree_flatten((list(args[1:]), kwargs))[0] if isinstance(a, InitShardedParameter)]
    if func == DATA_SETTER and sharded_target:
        return Kind.ASSIGN
    if func in VIEW_FUNCTIONS and sharded_target and not others:
        if func is not torch.Tensor.__getitem__ or _is_basic_index(args[1]):
            return Kind.VIEW
    if (func in ELEMENTWISE_WRITES or overwrites(func)) and sharded_target and not others:
        return Kind.LOCAL_WRITE
    if func in CONVERSIONS and sharded_target and not others:
        return Kind.CONVERSION
    name = getattr(func, "__name__", "")
    if sharded_target and name.endswith("_") and not name.endswith("__"):
        return Kind.OTHER_WRITE
    return Kind.READ


class InitShardedParameter(nn.Parameter):
    """A parameter built under :class:`~zeroshard.Init` (or a view of one): see the Note above."""

    _zeroshard_shard: torch.Tensor  # 1D, this rank's chunk of the padded flat parameter (roots only)
    _zeroshard_comm: Collectives
    _zeroshard_full: Optional[torch.Tensor] = None  # the full values while inside GatheredParameters
    #: a view's parameter and the view operations that lead from it to the view (None: a parameter)
    _zeroshard_root: Optional["InitShardedParameter"] = None
    _zeroshard_views: tuple[tuple[Any, tuple, dict], ...] = ()
    _zeroshard_id: int = -1

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True) -> "InitShardedParameter":
        return cast("InitShardedParameter", torch.Tensor._make_subclass(cls, data, requires_grad))

    @staticmethod
    def shard_of(param: torch.Tensor, comm: Collectives, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> "InitShardedParameter":
        if dtype is not None and param.is_floating_point():
            param = param.to(dtype)
        meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
        sharded = InitShardedParameter(meta, requires_grad=param.requires_grad)
        sharded.__dict__.update(param.__dict__)  # flags loaders set on it (transformers' _is_hf_initialized)
        sharded._zeroshard_comm = comm
        sharded._zeroshard_shard = torch.empty(0, dtype=param.dtype, device=device or comm.world.device)
        sharded._zeroshard_id = next(_NEXT_ID)
        sharded.keep_own(param.detach())
        return sharded

    # ------------------------------------------------------------------ DeepSpeed's ZeRO-3 attributes
    # ([Note: DeepSpeed's parameter attributes on zeroshard's own types] in sharding/stage3/param_status.py);
    # a view of a parameter has none, as a view of a DeepSpeed parameter has none
    def _own(self, name: str) -> "InitShardedParameter":
        if self._zeroshard_root is not None:
            raise AttributeError(f"{name}: a view of a parameter built under zeroshard.Init is not a parameter")
        return self

    @property
    def ds_id(self) -> int:
        """Unique in the process, in the order the parameters were built."""
        return self._own("ds_id")._zeroshard_id

    @property
    def ds_numel(self) -> int:
        return self._own("ds_numel").numel()

    @property
    def ds_shape(self) -> torch.Size:
        return self._own("ds_shape").shape

    @property
    def ds_status(self) -> ZeroParamStatus:
        """AVAILABLE inside ``GatheredParameters``, else NOT_AVAILABLE."""
        own = self._own("ds_status")
        return ZeroParamStatus.NOT_AVAILABLE if own._zeroshard_full is None else ZeroParamStatus.AVAILABLE

    @property
    def ds_tensor(self) -> torch.Tensor:
        """This rank's chunk of the padded flat parameter (1D)."""
        return self._own("ds_tensor")._zeroshard_shard

    # ------------------------------------------------------------------ the parameter behind a view
    def root(self) -> "InitShardedParameter":
        return self._zeroshard_root if self._zeroshard_root is not None else self

    def _view_of(self, func: Any, args: Sequence[Any], kwargs: dict) -> "InitShardedParameter":
        """A lazy view: the same chunk, seen through one more view operation."""
        with torch._C.DisableTorchFunctionSubclass():
            meta = torch.empty(self.shape, dtype=self.dtype, device="meta")
            shaped = func(meta, *args[1:], **kwargs)
        view = InitShardedParameter(shaped.detach(), requires_grad=False)
        view._zeroshard_root = self.root()
        view._zeroshard_comm = self._zeroshard_comm
        same = func in _SAME_VALUES and not args[1:] and not kwargs  # ``.data``, ``detach()``: all of it
        view._zeroshard_views = self._zeroshard_views if same else (
            *self._zeroshard_views, (func, tuple(args[1:]), dict(kwargs)))
        return view

    def _through_views(self, full: torch.Tensor) -> torch.Tensor:
        """What this (view of a) parameter is, given its parameter's full values."""
        for func, rest, kwargs in self._zeroshard_views:
            full = func(full, *rest, **kwargs)
        return full

    # ------------------------------------------------------------------ values
    def gather_full(self) -> torch.Tensor:
        """This parameter's full values in a temporary tensor (a collective: every rank must call it)."""
        root = self.root()
        comm, own = root._zeroshard_comm, root._zeroshard_shard
        padded = torch.empty(own.numel() * comm.world.world_size, dtype=own.dtype, device=own.device)
        comm.all_gather(padded, own, "init_gather")
        return padded[: root.numel()].view(root.shape)

    def _local_full(self, overwrites: bool) -> torch.Tensor:
        """A full-shaped scratch tensor holding this rank's chunk in its place (zeros elsewhere):
        enough for an elementwise write, which changes each element from that element alone."""
        root = self.root()
        own = root._zeroshard_shard
        if overwrites and not self._zeroshard_views:  # every element is written: nothing to keep
            return torch.empty(root.shape, dtype=root.dtype, device=own.device)
        padded = torch.zeros(own.numel() * root._zeroshard_comm.world.world_size, dtype=own.dtype,
                             device=own.device)
        start = root._zeroshard_comm.world.rank * own.numel()
        padded[start: start + own.numel()].copy_(own)
        return padded[: root.numel()].view(root.shape)

    def materialize(self) -> None:
        """Gather the full values and keep them until :meth:`dematerialize` (``GatheredParameters``):
        operations in between read and change them without collectives, so one rank alone may change
        them (``modifier_rank``)."""
        if self._zeroshard_full is None:
            self._zeroshard_full = self.gather_full().clone()

    def dematerialize(self, modifier_rank: Optional[int]) -> None:
        """Leave the gathered state: with ``modifier_rank``, that rank's values become every rank's
        (a broadcast), and each rank keeps its own chunk of them.  A shape changed inside the block
        (``.data = t`` of another shape, which every rank makes) is kept with this rank's values."""
        full, self._zeroshard_full = self._zeroshard_full, None
        if full is None:
            return
        reshaped = self._zeroshard_shard.numel() != self._chunk_numel(full.numel())
        if modifier_rank is None and not reshaped:
            return
        comm = self._zeroshard_comm
        if modifier_rank is not None and comm.world.is_distributed:
            comm.broadcast(full, modifier_rank, "gathered_parameters_modify")
        self.keep_own(full)

    def _chunk_numel(self, numel: int) -> int:
        return -(-numel // self._zeroshard_comm.world.world_size)

    def keep_own(self, full: torch.Tensor) -> None:
        """Keep this rank's chunk of ``full`` (the parameter's whole new values), resized if its
        number of elements changed."""
        own = self._zeroshard_shard
        chunk = self._chunk_numel(full.numel())
        if own.numel() != chunk:
            own = self._zeroshard_shard = torch.empty(chunk, dtype=full.dtype, device=own.device)
        start = self._zeroshard_comm.world.rank * chunk
        flat = full.detach().reshape(-1)
        real = max(0, min(chunk, flat.numel() - start))
        with torch.no_grad():
            own[:real].copy_(flat[start:start + real])
            own[real:].zero_()

    def _take_shape(self, like: torch.Tensor) -> None:
        """Show ``like``'s shape and dtype from now on (``.data = t``)."""
        with torch._C.DisableTorchFunctionSubclass():
            torch.Tensor.data.__set__(self, torch.empty(like.shape, dtype=like.dtype, device="meta"))  # type: ignore[attr-defined]

    def assign(self, value: torch.Tensor) -> None:
        """``param.data = value``: the parameter takes ``value``'s shape, dtype and values (this rank's
        chunk of them), as every rank's assignment makes it, with no collective."""
        if self._zeroshard_views:
            raise ShardedParameterError("assigning .data of a view of a sharded parameter is not supported; "
                                        "assign the parameter's own .data")
        if isinstance(value, InitShardedParameter):  # another sharded tensor's values (a conversion's)
            source = value.root()
            if source is self:
                return
            if source._zeroshard_views:
                raise ShardedParameterError("cannot assign a view of a sharded parameter as .data")
            self._zeroshard_shard = source._zeroshard_shard
            self._take_shape(source)
            return
        self._take_shape(value)
        if self._zeroshard_full is not None:  # inside GatheredParameters: the gathered values change
            self._zeroshard_full = value.detach()
            return
        if self._zeroshard_shard.dtype != value.dtype:
            self._zeroshard_shard = self._zeroshard_shard.to(value.dtype)
        self.keep_own(value)

    def converted(self, func: Any, args: Sequence[Any], kwargs: dict) -> torch.Tensor:
        """``.to(dtype)``, ``.half()``, ``clone()``, ...: the same conversion of this rank's chunk, as a
        new sharded tensor (a view's values are not on this rank: refused)."""
        own = self.root()._zeroshard_shard
        with torch._C.DisableTorchFunctionSubclass():
            moved = func(own, *args[1:], **kwargs)
        # every conversion keeps the shape and gives the chunk's new dtype; the shape is held on the meta
        # device, which a device conversion (``cpu()``, ``to(device)``) cannot run on
        shaped = torch.empty(self.shape, dtype=moved.dtype, device="meta")
        if moved is own and func is not torch.Tensor.clone:
            return self
        result = InitShardedParameter(shaped.detach(), requires_grad=False)
        result._zeroshard_comm = self._zeroshard_comm
        result._zeroshard_shard = moved if moved is not own else own.clone()
        return result

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if not args and "tensor" in kwargs:  # nn.init's functions hand their tensor over by keyword
            args = (kwargs.pop("tensor"),)
        kind = classify(func, args, kwargs)
        if kind is Kind.METADATA:
            if func == DEVICE_GETTER:  # the device it computes on (see placeholder.py)
                return args[0].root()._zeroshard_shard.device
            if func == IS_META_GETTER:
                return False
            return super().__torch_function__(func, types, args, kwargs)
        target = args[0] if args and isinstance(args[0], InitShardedParameter) else None
        if target is not None and kind is Kind.ASSIGN:
            return target.assign(args[1])
        if _any_gathered(args, kwargs):  # inside GatheredParameters: plain operations on the full values
            return _apply_on_full(func, args, kwargs)
        if target is not None and kind is Kind.VIEW:
            return target._view_of(func, args, kwargs)
        if target is not None and kind is Kind.LOCAL_WRITE:
            return _write_locally(func, target, args, kwargs)
        if target is not None and kind is Kind.CONVERSION and not target._zeroshard_views:
            return target.converted(func, args, kwargs)
        return _apply_on_full(func, args, kwargs)


def _read_error(param: "InitShardedParameter", func: Any) -> ShardedParameterError:
    name = getattr(func, "__name__", str(func))
    return ShardedParameterError(
        f"{name}() would read the values of a parameter of shape {tuple(param.root().shape)} built under "
        f"zeroshard.Init, which exist only across ranks (each holds 1/N); gathering them is a collective "
        f"that every rank must make. Read it inside `with zeroshard.GatheredParameters(param):` on every "
        f"rank, or after initialize() through engine.full_state_dict(); code that every rank runs and that "
        f"reads weights (model surgery such as resize_token_embeddings) may run inside `with "
        f"zeroshard.Init():`, where a read gathers")


def _any_gathered(args: Any, kwargs: dict) -> bool:
    return any(isinstance(a, InitShardedParameter) and a.root()._zeroshard_full is not None
               for a in tree_flatten((list(args), kwargs))[0])


def _write_locally(func: Any, target: InitShardedParameter, args: Any, kwargs: dict) -> InitShardedParameter:
    """An elementwise write: on a scratch tensor holding this rank's chunk in place; the chunk is kept."""
    root = target.root()
    scratch = target._local_full(overwrites=overwrites(func))
    view = target._through_views(scratch)
    with torch.no_grad():
        func(view, *args[1:], **kwargs)
    root.keep_own(scratch)
    return target


def _apply_on_full(func: Any, args: Any, kwargs: dict) -> Any:
    """The operation on full values: a parameter inside ``GatheredParameters`` lends its gathered
    values (no collective); any other is gathered (inside the Init block: a collective every rank
    makes; outside it, a read refused) and keeps whatever the operation left in it."""
    gathered: dict[int, tuple[InitShardedParameter, torch.Tensor]] = {}

    def full(a: Any) -> Any:
        if not isinstance(a, InitShardedParameter):
            return a
        root = a.root()
        if root._zeroshard_full is not None:
            return a._through_views(root._zeroshard_full)
        if not constructing():
            raise _read_error(a, func)
        if id(root) not in gathered:
            gathered[id(root)] = (root, root.gather_full())
        return a._through_views(gathered[id(root)][1])

    plain_args, plain_kwargs = tree_map(full, args), tree_map(full, kwargs)
    with torch.no_grad():
        result = func(*plain_args, **plain_kwargs)
        for root, values in gathered.values():
            root.keep_own(values)
    target = args[0] if args else None
    if isinstance(target, InitShardedParameter) and result is plain_args[0]:
        return target  # an in-place operation returns its (sharded) target
    return result


#: how many ``zeroshard.Init`` blocks are open in this process (see the Note: construction)
_OPEN_BLOCKS = [0]


def constructing() -> bool:
    """True inside a ``zeroshard.Init`` block, where every rank runs the same construction code."""
    return _OPEN_BLOCKS[0] > 0


def enter_construction() -> None:
    _OPEN_BLOCKS[0] += 1


def leave_construction() -> None:
    _OPEN_BLOCKS[0] -= 1
