"""Stage 3 moves a model's parameters to the training device one at a time, as their buckets are filled.

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
from typing import Callable, Iterable

import torch
from torch import nn


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
