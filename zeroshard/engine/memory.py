"""The engine's memory breakdown: the bytes this rank holds, by category, beside the ZeRO formula."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..experts.memory import expert_breakdown
from ..planning import model_state_bytes
from ..precision import PrecisionPolicy

if TYPE_CHECKING:
    from ..optim.updater import ShardUpdater
    from ..sharding import ShardingStrategy


def memory_breakdown(strategy: "ShardingStrategy", updater: "ShardUpdater", precision: PrecisionPolicy,
                     frozen_params: list[nn.Parameter], module: nn.Module, expert_parallel_size: int
                     ) -> dict[str, float]:
    """``Engine.memory_breakdown`` (see [Note: what the breakdown counts] in planning/accounting.py)."""
    params, param_padding = strategy.param_bytes()
    frozen_sharded, frozen_padding = strategy.frozen_bytes()
    grads, grad_padding = strategy.grad_bytes()
    placed = updater.memory()  # optimizer state, fp32 masters included (12 bytes = 4 + 8)
    opt_real, opt_padding, opt_other = placed["real"], placed["padding"], placed["other"]
    out: dict[str, float] = {
        "params": params,
        "grads": grads,
        "optimizer": opt_real,
        "padding": param_padding + grad_padding + opt_padding + frozen_padding,
        "optimizer_other": opt_other,
        "frozen_params": frozen_sharded + sum(p.numel() * p.element_size() for p in frozen_params),
        "buffers": sum(b.numel() * b.element_size() for b in module.buffers()),
        "comm_buffers": strategy.comm_buffer_bytes(),
        **strategy.extra_memory(),
    }
    out["model_states"] = out["params"] + out["grads"] + out["optimizer"]
    # Where the model states are (real elements): offloaded optimizer state and parameters are
    # counted in host memory or on NVMe, the rest on the training device.
    param_host, param_nvme = strategy.param_placement()
    out["on_host"] = placed["host"] + param_host
    out["on_nvme"] = placed["nvme"] + param_nvme
    out["on_device"] = out["model_states"] - out["on_host"] - out["on_nvme"]
    out["offload_buffers"] = placed["host_buffers"]
    grad_size = torch.empty((), dtype=precision.grad_accum).element_size()
    kind, optimizer_bytes = "mixed" if precision.mixed else "fp32", 12 if strategy.masters is not None else None
    out["formula"] = model_state_bytes(strategy.stage, strategy.layout.numel, strategy.world.world_size,
                                       kind, grad_size, optimizer_bytes).total
    if expert_parallel_size > 1:  # this rank's experts apart, each part's formula over its own group
        out.update(expert_breakdown(strategy, opt_real, kind, grad_size, optimizer_bytes))
        out["dense_model_states"] = out["model_states"] - out["expert_model_states"]
        out["formula"] = out["dense_formula"] + out["expert_formula"]
    return out
