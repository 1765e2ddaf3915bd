"""``zeroshard.Init``: build a model whose full size would not fit one rank, already sharded.

    with zeroshard.Init():
        model = MyModel(...)            # each parameter is sharded the moment it is registered
    engine, *_ = zeroshard.initialize(model=model, config=config)   # stage 3

[Note: sharding at registration, initialising on the fly]
A global parameter-registration hook replaces every parameter, as its module registers it, by an
:class:`InitShardedParameter` that keeps only this rank's 1/N of its elements (a padded flat chunk)
and shows the full shape.  Modules initialise their parameters *after* registering them
(``reset_parameters()``, a parent's ``apply(init_fn)``, Hugging Face's ``post_init``); any torch
operation on a sharded parameter therefore gathers that one parameter into a temporary full tensor,
applies the operation to it, and keeps this rank's chunk of the result (an initialiser that overwrites
every element, such as ``normal_`` or ``kaiming_uniform_``, skips the gather and starts from an
empty tensor).  The random number generator
is consumed exactly as in a plain construction, so the same seed gives the same initial values, and
peak memory is the shards built so far plus about one parameter.  Every rank must run the same
construction code (it issues collectives), as under torchrun it does.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, cast

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .distributed.collectives import Collectives
from .distributed.world import World, init_distributed
from .memory.file_pages import drop_mapped_pages
from .sharding.placeholder import DEVICE_GETTER, METADATA_FUNCTIONS
from .sharding.units import rebind_external_parameters



#: ``requires_grad_`` and ``p.requires_grad = ...`` (a model frozen under Init, as LoRA code does) change
#: the parameter itself, not a gathered copy of its values
_FLAG_FUNCTIONS = frozenset({torch.Tensor.requires_grad_, getattr(torch.Tensor.requires_grad, "__set__")})


def _overwriting_functions() -> frozenset:
    """Initialisers that overwrite every element without reading it: no need to gather first."""
    init_names = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                  "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                  "sparse_")
    tensor_names = ("uniform_", "normal_", "zero_", "fill_", "random_", "exponential_", "geometric_",
                    "log_normal_", "cauchy_")
    return frozenset([getattr(nn.init, n) for n in init_names if hasattr(nn.init, n)]
                     + [getattr(torch.Tensor, n) for n in tensor_names])


_OVERWRITING = _overwriting_functions()


class InitShardedParameter(nn.Parameter):
    """A parameter built under :class:`Init`: full shape on the outside, 1/N of its elements inside."""

    _zeroshard_shard: torch.Tensor  # 1D, this rank's chunk of the padded flat parameter
    _zeroshard_comm: Collectives
    _zeroshard_full: Optional[torch.Tensor] = None  # the full values while inside GatheredParameters

    def __new__(cls, data: torch.Tensor, requires_grad: bool = True) -> "InitShardedParameter":
        return cast("InitShardedParameter", torch.Tensor._make_subclass(cls, data, requires_grad))

    @staticmethod
    def shard_of(param: torch.Tensor, comm: Collectives, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> "InitShardedParameter":
        n = comm.world.world_size
        chunk = -(-param.numel() // n)
        if dtype is not None and param.is_floating_point():
            param = param.to(dtype)
        flat = param.detach().reshape(-1)
        own = torch.empty(chunk, dtype=param.dtype, device=device or comm.world.device)
        start = comm.world.rank * chunk
        real = max(0, min(chunk, flat.numel() - start))
        own[:real].copy_(flat[start:start + real])  # one pass over fresh memory, not a zero fill and a copy
        own[real:].zero_()
        meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
        sharded = InitShardedParameter(meta, requires_grad=param.requires_grad)
        sharded.__dict__.update(param.__dict__)  # flags loaders set on it (transformers' _is_hf_initialized)
        sharded._zeroshard_shard = own
        sharded._zeroshard_comm = comm
        return sharded

    def gather_full(self) -> torch.Tensor:
        """This parameter's full values in a temporary tensor (a collective: every rank must call it)."""
        comm, own = self._zeroshard_comm, self._zeroshard_shard
        padded = torch.empty(own.numel() * comm.world.world_size, dtype=own.dtype, device=own.device)
        comm.all_gather(padded, own, "init_gather")
        return padded[: self.numel()].view(self.shape)

    def materialize(self) -> None:
        """Gather the full values and keep them until :meth:`dematerialize` (``GatheredParameters``):
        operations in between read and change them without collectives, so one rank alone may change
        them (``modifier_rank``)."""
        if self._zeroshard_full is None:
            self._zeroshard_full = self.gather_full().clone()

    def dematerialize(self, modifier_rank: Optional[int]) -> None:
        """Leave the gathered state: with ``modifier_rank``, that rank's values become every rank's
        (a broadcast), and each rank keeps its own chunk of them."""
        full, self._zeroshard_full = self._zeroshard_full, None
        if full is None or modifier_rank is None:
            return
        comm = self._zeroshard_comm
        if comm.world.is_distributed:
            comm.broadcast(full, modifier_rank, "gathered_parameters_modify")
        self.keep_own(full)

    def keep_own(self, full: torch.Tensor) -> None:
        own = self._zeroshard_shard
        start = self._zeroshard_comm.world.rank * own.numel()
        flat = full.detach().reshape(-1)
        real = max(0, min(own.numel(), flat.numel() - start))
        own[:real].copy_(flat[start:start + real])

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in METADATA_FUNCTIONS or func in _FLAG_FUNCTIONS:
            return super().__torch_function__(func, types, args, kwargs)
        if func == DEVICE_GETTER:  # the device it computes on (see placeholder.py)
            return args[0]._zeroshard_comm.world.device
        materialized: dict[int, tuple[InitShardedParameter, torch.Tensor]] = {}

        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        overwrites = func in _OVERWRITING

        gathered: dict[int, tuple[InitShardedParameter, torch.Tensor]] = {}

        def full(a: Any) -> Any:
            if isinstance(a, InitShardedParameter) and a._zeroshard_full is not None:
                gathered[id(a)] = (a, a._zeroshard_full)  # inside GatheredParameters: no collective
                return a._zeroshard_full
            if isinstance(a, InitShardedParameter):
                if id(a) not in materialized:
                    values = (torch.empty(a.shape, dtype=a.dtype, device=a._zeroshard_shard.device)
                              if overwrites and a is target else a.gather_full())
                    materialized[id(a)] = (a, values)
                return materialized[id(a)][1]
            return a

        plain_args, plain_kwargs = tree_map(full, args), tree_map(full, kwargs)
        with torch.no_grad():
            result = func(*plain_args, **plain_kwargs)
            for param, values in materialized.values():
                param.keep_own(values)  # in place or not: keep whatever the operation left
        for param, values in (*materialized.values(), *gathered.values()):
            if result is values:
                return param  # an in-place operation returns its (sharded) target
        return result


class Init:
    """Context manager: parameters created inside are sharded over the data-parallel world at once."""

    def __init__(self, config: Any = None, enabled: bool = True, world: Optional[World] = None,
                 dtype: Optional[torch.dtype] = None, shard_device: Optional[torch.device] = None) -> None:
        """``dtype``: build floating-point parameters in this dtype (default: as the model makes them);
        ``shard_device``: where the shards live until ``initialize()`` (default: the training device)."""
        from .config import ZeroshardConfig, load_config
        from .config.loader import read_config_source, without_auto

        self.enabled = enabled
        self.dtype = dtype
        self.shard_device = shard_device
        # "auto" values (a Hugging Face config before the Trainer fills them) do not concern Init
        self.config = config if config is None or isinstance(config, ZeroshardConfig) else \
            load_config(without_auto(read_config_source(config)))
        timeout = self.config.collective_timeout if self.config is not None else 1800.0
        self.world = world or init_distributed(timeout_s=timeout)
        self.comm = Collectives(self.world)
        self._handle: Any = None
        #: bytes of mapped checkpoint pages given back after sharding ([Note: mapped checkpoint pages under Init])
        self.released_file_bytes = 0

    def _on_register(self, module: nn.Module, name: str, param: nn.Parameter) -> Optional[nn.Parameter]:
        if param is None or isinstance(param, InitShardedParameter):
            return None  # already sharded (a tied weight registered a second time)
        if param.is_meta:  # no values yet (transformers' from_pretrained builds on meta, then assigns each
            return None   # loaded parameter: that assignment comes through here again and is sharded)
        sharded = InitShardedParameter.shard_of(param, self.comm, self.dtype, self.shard_device)
        # a view into a mapped checkpoint file: [Note: mapped checkpoint pages under Init]
        self.released_file_bytes += drop_mapped_pages(param)
        return sharded

    def __enter__(self) -> "Init":
        if self.enabled:
            # torch's stub says the hook returns None; its documentation says it may return a replacement
            hook = cast(Callable[..., None], self._on_register)
            self._handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def has_init_params(model: nn.Module) -> bool:
    return any(isinstance(p, InitShardedParameter) for p in model.parameters())


def adopt_init_params(model: nn.Module, device: torch.device
                      ) -> tuple[dict[int, nn.Parameter], dict[int, Callable[[], torch.Tensor]]]:
    """Swap each :class:`InitShardedParameter` for a plain ``nn.Parameter`` the engine can own.

    Each becomes a parameter with the full shape and no storage, whose values stage 3 gathers from
    the shards when it fills its bucket (one parameter at a time); a frozen one that stage 3 keeps
    whole is gathered after the buckets are built.  Returns ``id(old) -> new`` (an optimizer built
    before initialize() holds the old ones) and ``id(new) -> gather``.
    """
    replaced: dict[int, nn.Parameter] = {}
    pending: dict[int, Callable[[], torch.Tensor]] = {}
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if not isinstance(p, InitShardedParameter):
                continue
            if id(p) not in replaced:
                fresh = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                fresh.untyped_storage().resize_(0)
                pending[id(fresh)] = p.gather_full
                replaced[id(p)] = fresh
            module._parameters[attr] = replaced[id(p)]
    rebind_external_parameters(replaced)
    return replaced, pending
