"""Build a torch optimizer over the chunks a rank owns: zeroshard wraps torch's optimizers, never rewrites them."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.optim import Optimizer

from ..config.spec_params import OPTIMIZER_PARAMS, resolve
from .fused_adam import DeepSpeedCPUAdam, FusedAdam
from .muon import from_muon_config


def _foreach_kwargs() -> dict[str, Any]:
    """torch's multi-tensor (foreach) kernels: measured faster than the per-tensor loop on CPU too.

    The engine steps one bucket's chunk at a time (see [Note: stepping bucket by bucket] in
    engine/optimizer_step.py), so foreach's temporaries are the size of one chunk, never of the whole shard.
    """
    return {"foreach": True}


def _adam_kwargs() -> dict[str, Any]:
    """Adam/AdamW: torch's fused kernel (CPU and CUDA), one pass over memory per tensor.

    Several times the foreach implementation's parameters per second on CPU (benchmarks/RESULTS.md,
    section "Offload"), which matters most where the update runs on the host (optimizer offload).
    """
    return {"fused": True}


def from_config(type_name: str, params: dict, groups: Sequence[dict], on_host: bool = False) -> Optimizer:
    """An optimizer from the config's ``optimizer`` block (``on_host``: the optimizer is offloaded, so
    it steps host memory).

    DeepSpeed's ``Adam`` applies decoupled weight decay unless ``adam_w_mode`` is false (AdamW's rule);
    with ``adam_w_mode: false`` it is Adam's L2 penalty.

    [Note: which Adam class the config builds]
    DeepSpeed's ``torch_adam`` picks torch's ``Adam``/``AdamW`` classes (true) or its own fused kernel
    (false, the default): ``FusedAdam``, or ``DeepSpeedCPUAdam`` where the optimizer runs on the host
    (offload_optimizer).  zeroshard builds the class DeepSpeed would, so code that checks the type it
    got back sees DeepSpeed's answer; every one of them is torch's fused kernel (optim/fused_adam.py),
    one update rule, so the choice changes the class and nothing the weights see.
    """
    if type_name == "Muon":
        return from_muon_config(params, list(groups))
    full = resolve(params, OPTIMIZER_PARAMS[type_name], f"optimizer.params ({type_name})")
    if type_name == "SGD":
        return torch.optim.SGD(groups, **full, **_foreach_kwargs())
    adam_w = type_name == "AdamW" or full.pop("adam_w_mode", True)
    torch_adam = full.pop("torch_adam", False)
    full["betas"] = tuple(full["betas"])
    if torch_adam:
        cls = torch.optim.AdamW if adam_w else torch.optim.Adam
        return cls(groups, **full, **_adam_kwargs())
    if on_host:
        return DeepSpeedCPUAdam(groups, **full, adamw_mode=adam_w)
    return FusedAdam(groups, **full, adam_w_mode=adam_w)


def from_user(factory: Callable[..., Optimizer], groups: Sequence[dict]) -> Optimizer:
    """An optimizer from a callable passed to ``initialize(optimizer=...)`` (a class or a factory),
    called with zeroshard's parameter groups (one chunk tensor per bucket)."""
    return factory(list(groups))
