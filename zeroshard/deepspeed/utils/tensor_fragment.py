"""``deepspeed.utils.tensor_fragment``: a parameter's fp32 value, optimizer state and gradient, by parameter.

The *full* functions deal in the whole tensor, in the parameter's shape: the getters gather it over
the ranks that share the parameter (a collective: every rank calls them, for the same parameters in
the same order), the setters take the same whole value on every rank.  The *local* functions deal in
this rank's fragment: the 1D run of the flattened parameter whose optimizer state this rank owns (the
whole parameter at stage 0; at stages 1-3 a run of it, possibly empty, and the ranks' runs, in rank
order, tile it); the local getters are not collectives, and neither is setting a local gradient or
optimizer state, while setting a local fp32 value is at stages 1-3, which gather the parameter again.
See [Note: a parameter's fragment] in deepspeed/param_fragments.py for where these live.

Every value returned is a new fp32 tensor on the training device.  A parameter that no live engine
trains (frozen, or never wrapped) gives None, and the setters ignore it; a gradient exists from the
backward at a gradient accumulation boundary until ``step()`` and is None outside that window, where
setting one raises.  A gradient is the averaged one the next step applies, before clipping and
without the fp16 loss scale.  Setting an fp32 value reaches the parameter the model computes with at
once (see [Note: what a fragment write reaches] in deepspeed/param_fragments.py).  An optimizer
state key (``"exp_avg"``, ``"exp_avg_sq"`` for Adam) exists from the optimizer's first step on.
``fragment_address`` is the name DeepSpeed's checkpoint files pickle a fragment's place by (a record of
its values, as checkpoint/deepspeed_format/unpickle.py reads it).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from ...checkpoint.deepspeed_format.unpickle import fragment_address
from ..param_fragments import GradientsUnavailableError, ParamFragment

__all__ = ["fragment_address", "safe_get_full_fp32_param", "safe_set_full_fp32_param",
           "safe_get_full_optimizer_state", "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_set_full_grad",
           "safe_update_full_grad_vectorized", "safe_get_local_fp32_param", "safe_set_local_fp32_param",
           "safe_get_local_optimizer_state", "safe_set_local_optimizer_state", "safe_get_local_grad",
           "safe_set_local_grad", "GradientsUnavailableError"]


def _assemble(fragment: ParamFragment, local: torch.Tensor) -> torch.Tensor:
    """Every rank's fragment in one tensor of the parameter's shape (an all-reduce over the shard group)."""
    out = torch.zeros(fragment.slot.numel, dtype=torch.float32, device=fragment.device)
    start, end = fragment.in_param
    out[start:end].copy_(local)
    strategy = fragment.engine.strategy
    comm = strategy.comm_of(fragment.bucket)  # an experts' bucket: the ranks that hold the same experts
    if not strategy.traits.owns_whole_buckets and comm.world.is_distributed:
        comm.all_reduce(out, f"full_fragment[{fragment.slot.name}]")
    return out.view(fragment.slot.shape)


def _own_part(fragment: ParamFragment, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole value, flat fp32 on the device, and this rank's fragment of it."""
    flat = fragment.flat_value(value, local=False)
    start, end = fragment.in_param
    return flat, flat[start:end]


# ---------------------------------------------------------------------- whole tensors
def safe_get_full_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The parameter's fp32 value (the master weights under mixed precision); a collective."""
    fragment = ParamFragment.of(param)
    return None if fragment is None else _assemble(fragment, fragment.read())


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the parameter's fp32 value, and the parameter the model computes with, to ``value`` (the
    same on every rank)."""
    fragment = ParamFragment.of(param)
    if fragment is None:
        return
    flat, own = _own_part(fragment, value)
    fragment.write(own)
    fragment.publish(flat, own)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    """The parameter's optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``); a collective."""
    fragment = ParamFragment.of(param)
    if fragment is not None and fragment.stepped_whole(optim_state_key):
        return fragment.read_whole_state(optim_state_key)
    return None if fragment is None else _assemble(fragment, fragment.read(optim_state_key))


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the parameter's optimizer state ``optim_state_key`` to ``value`` (the same on every rank)."""
    fragment = ParamFragment.of(param)
    if fragment is not None and fragment.stepped_whole(optim_state_key):
        fragment.write_whole_state(optim_state_key, value)
    elif fragment is not None:
        fragment.write(_own_part(fragment, value)[1], optim_state_key)


def safe_get_full_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The parameter's averaged gradient, or None outside the window (see the module's docstring); a
    collective.  A tensor no engine trains gives its own ``.grad``."""
    fragment = ParamFragment.of(param)
    if fragment is None:
        return param.grad
    local = fragment.read_grad()
    return None if local is None else _assemble(fragment, local)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the gradient the next step applies to ``value`` (the same on every rank)."""
    fragment = ParamFragment.of(param)
    if fragment is None:
        if param.grad is not None:
            param.grad.copy_(value)
        return
    fragment.write_grad(_own_part(fragment, value)[1])


def safe_update_full_grad_vectorized(param_list: Iterable[torch.Tensor],
                                     update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Replace each parameter's gradient ``g`` by ``update_func(g, param)``; a collective."""
    for param in param_list:
        grad = safe_get_full_grad(param)
        if grad is not None:
            safe_set_full_grad(param, update_func(grad, param))


# ---------------------------------------------------------------------- this rank's fragment
def safe_get_local_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's fragment of the parameter's fp32 value (1D)."""
    fragment = ParamFragment.of(param)
    return None if fragment is None else fragment.read()


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's fragment of the parameter's fp32 value; every rank sets its own (a collective at
    stages 1-3: the parameter is gathered again from the ranks' fragments)."""
    fragment = ParamFragment.of(param)
    if fragment is None:
        return
    own = fragment.flat_value(value, local=True)
    fragment.write(own)
    fragment.publish(None, own)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    """This rank's fragment of the parameter's optimizer state ``optim_state_key`` (1D)."""
    fragment = ParamFragment.of(param)
    if fragment is not None and fragment.stepped_whole(optim_state_key):  # on its owner: a collective
        start, end = fragment.in_param
        return fragment.read_whole_state(optim_state_key).reshape(-1)[start:end].clone()
    return None if fragment is None else fragment.read(optim_state_key)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's fragment of the parameter's optimizer state ``optim_state_key``."""
    fragment = ParamFragment.of(param)
    if fragment is not None and fragment.stepped_whole(optim_state_key):
        raise ValueError(f"{fragment.slot.name} is stepped whole on one rank, which keeps its {optim_state_key!r}: "
                         f"set it with safe_set_full_optimizer_state")
    if fragment is not None:
        fragment.write(fragment.flat_value(value, local=True), optim_state_key)


def safe_get_local_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's fragment of the parameter's averaged gradient (1D), or None outside the window."""
    fragment = ParamFragment.of(param)
    return None if fragment is None else fragment.read_grad()


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's fragment of the gradient the next step applies."""
    fragment = ParamFragment.of(param)
    if fragment is not None:
        fragment.write_grad(fragment.flat_value(value, local=True))
