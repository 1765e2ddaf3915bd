"""Where the model's parameters go: a model built under ``zeroshard.Init`` is adopted as it is; stage 3
moves the others to the training device one at a time, as their buckets are filled; frozen parameters
the storage does not hold stay whole.

[Note: stage 3 moves parameters to the device as their buckets fill]
``model.to(device)`` would put the whole fp32 model on every GPU before stage 3 shards it: a model
that only fits sharded would run out of device memory in ``initialize()``, before the sharding that
makes it fit.  So at stage 3 each parameter of a model built outside ``zeroshard.Init`` gives its
values up to a function and becomes an empty tensor of its shape on the device (no memory), as
``zeroshard.Init``'s parameters are when the engine adopts them; the storage calls that function as
it fills the parameter's bucket, which copies the values to the device and broadcasts rank 0's (the
start every rank shares, as DistributedDataParallel's), and the storage copies them into the bucket
and keeps this rank's chunk.  The device then holds at most one bucket being filled and one
parameter beyond the shards, and each value leaves host memory once its bucket holds it.  Parameters
that stage 3 keeps whole (small frozen ones) are moved the same way after the buckets.  On a CPU the
function hands back the tensor itself: no copy.  A function runs once, and every rank calls them in
the same order (the buckets' order), as every broadcast requires.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Iterable

import torch
from torch import nn

from ..sharding import STRATEGIES
from ..sharding.stage3.init_context import adopt_init_params, has_init_params
from ..sharding.storage import HOMES

if TYPE_CHECKING:
    from ..config import ZeroshardConfig
    from ..precision import PrecisionPolicy

#: id(param) -> gathers the full values of a parameter built under zeroshard.Init
FromInit = dict[int, Callable[[], torch.Tensor]]


def adopt_init_parameters(model: nn.Module, config: "ZeroshardConfig", device: torch.device
                          ) -> tuple[dict[int, nn.Parameter], FromInit]:
    """A model built under ``zeroshard.Init`` (stage 3 only): its parameters, made ordinary ones on
    ``device``, and how to gather each one's full values; nothing for any other model."""
    if not has_init_params(model):
        return {}, {}
    if not STRATEGIES[config.stage].traits.shards_parameters:
        raise ValueError(f"the model was built under zeroshard.Init, which needs ZeRO stage 3; the "
                         f"config says zero_optimization.stage = {config.stage}")
    return adopt_init_params(model, device)


def defer_to_device(params: Iterable[nn.Parameter], device: torch.device,
                    broadcast: Callable[[nn.Parameter, torch.Tensor], None]) -> dict[int, Callable[[], torch.Tensor]]:
    """Make each parameter an empty tensor of its shape on ``device``; returns ``id(param)`` -> the
    function that gives its values on ``device``, rank 0's (``broadcast(param, values)`` makes them
    so), once."""
    moves: dict[int, Callable[[], torch.Tensor]] = {}
    for p in params:
        if id(p) in moves:
            continue
        values = [p.data]
        empty = torch.empty(p.shape, dtype=p.dtype, device=device)
        empty.untyped_storage().resize_(0)
        p.data = empty
        moves[id(p)] = _mover(values, device, functools.partial(broadcast, p))
    return moves


def _mover(values: list[torch.Tensor], device: torch.device,
           broadcast: Callable[[torch.Tensor], None]) -> Callable[[], torch.Tensor]:
    def move() -> torch.Tensor:
        if not values:
            raise RuntimeError("a parameter's values were moved to the device twice")
        on_device = to_device(values.pop(), device)  # the host copy goes with this frame
        broadcast(on_device)
        return on_device
    return move


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One parameter's values on ``device`` (the tensor itself when it is there already)."""
    return values.to(device)


def keep_frozen_whole(frozen: list[nn.Parameter], from_init: dict[int, Callable[[], torch.Tensor]],
                      model: nn.Module, precision: "PrecisionPolicy") -> list[nn.Parameter]:
    """The frozen parameters the storage does not hold, which stay whole in their modules (all of them
    below stage 3; see [Note: frozen parameters at stage 3] in sharding/stage3/units.py), with full
    values, in the compute dtype like the rest of the model."""
    whole = [p for p in frozen if HOMES.home_of(p) is None]
    with torch.no_grad():
        for p in whole:
            if id(p) in from_init:  # built under Init, or moved at stage 3: its values now, in order
                p.data = from_init[id(p)]().clone()
    _convert_rest_of_model(whole, model, precision)
    return whole


def _convert_rest_of_model(frozen: list[nn.Parameter], model: nn.Module, precision: "PrecisionPolicy") -> None:
    """Mixed precision: frozen parameters and floating-point buffers compute in 16 bits too, as
    DeepSpeed's ``module.half()`` / ``bfloat16()`` makes them (the trainable ones already do)."""
    if not precision.mixed:
        return
    dtype = precision.compute
    with torch.no_grad():
        for p in frozen:
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None and b.is_floating_point():
                    module._buffers[name] = b.to(dtype)
