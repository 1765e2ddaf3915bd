"""``zeroshard.Init``: build a model whose full size would not fit one rank, already sharded.

    with zeroshard.Init():
        model = MyModel(...)            # each parameter is sharded the moment it is registered
    engine, *_ = zeroshard.initialize(model=model, config=config)   # stage 3

[Note: sharding at registration, initialising on the fly]
A global parameter-registration hook replaces every parameter, as its module registers it, by an
:class:`InitShardedParameter` that keeps only this rank's 1/N of its elements (a padded flat chunk)
and shows the full shape.  Modules initialise their parameters *after* registering them
(``reset_parameters()``, a parent's ``apply(init_fn)``, Hugging Face's ``post_init``).  An
initialiser or any other elementwise write runs on this rank's chunk alone; inside the block, an
operation that reads the values gathers that one parameter into a temporary full tensor, applies
the operation to it, and keeps this rank's chunk of the result.  The random number generator is
consumed exactly as in a plain construction, so the same seed gives the same initial values, and
peak memory is the shards built so far plus about one parameter.  Every rank must run the same
construction code (a read issues a collective), as under torchrun it does.  After the block, reads
raise instead (see [Note: what an Init-built parameter does with each operation] in
sharding/stage3/init_param.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, cast

import torch
from torch import nn

from ...distributed.collectives import Collectives
from ...distributed.world import World, init_distributed
from ...host.file_pages import drop_mapped_pages
from .init_param import InitShardedParameter, enter_construction, leave_construction
from .units import rebind_external_parameters


class Init:
    """Context manager: parameters created inside are sharded over the data-parallel world at once."""

    def __init__(self, config: Any = None, enabled: bool = True, world: Optional[World] = None,
                 dtype: Optional[torch.dtype] = None, shard_device: Optional[torch.device] = None) -> None:
        """``dtype``: build floating-point parameters in this dtype (default: as the model makes them);
        ``shard_device``: where the shards live until ``initialize()`` (default: the training device)."""
        from ...config import ZeroshardConfig, load_config
        from ...config.loader import read_config_source, without_auto

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
        #: bytes of mapped checkpoint pages given back after sharding ([Note: mapped checkpoint pages under
        #: Init] in host/file_pages.py)
        self.released_file_bytes = 0

    def _on_register(self, module: nn.Module, name: str, param: nn.Parameter) -> Optional[nn.Parameter]:
        if param is None or isinstance(param, InitShardedParameter):
            return None  # already sharded (a tied weight registered a second time)
        if param.is_meta:  # no values yet (transformers' from_pretrained builds on meta, then assigns each
            return None   # loaded parameter: that assignment comes through here again and is sharded)
        sharded = InitShardedParameter.shard_of(param, self.comm, self.dtype, self.shard_device)
        # a view into a mapped checkpoint file: [Note: mapped checkpoint pages under Init] in
        # host/file_pages.py
        self.released_file_bytes += drop_mapped_pages(param)
        return sharded

    def __enter__(self) -> "Init":
        if self.enabled:
            # torch's stub says the hook returns None; its documentation says it may return a replacement
            hook = cast(Callable[..., None], self._on_register)
            self._handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
            enter_construction()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            leave_construction()


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
