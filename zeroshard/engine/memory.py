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
    if updater.matrices is not None:
        out["formula"] = whole_matrix_formula(strategy, updater, kind, grad_size)
    if expert_parallel_size > 1:  # this rank's experts apart, each part's formula over its own group
        out.update(expert_breakdown(strategy, opt_real, kind, grad_size, optimizer_bytes))
        out["dense_model_states"] = out["model_states"] - out["expert_model_states"]
        out["formula"] = out["dense_formula"] + out["expert_formula"]
    return out


def whole_matrix_formula(strategy: "ShardingStrategy", updater: "ShardUpdater", kind: str, grad_size: int) -> float:
    """The formula when some groups are stepped whole (see [Note: whole matrices, each on one rank] in
    optim/whole_matrices.py): the stage's parameters and gradients, AdamW's two fp32 tensors for the
    elements stepped in chunks, fp32 masters if any (1/N from stage 1), and the whole-matrix
    optimizer's state 1/N at every stage."""
    matrices = updater.matrices
    assert matrices is not None
    n, stage, numel = strategy.world.world_size, strategy.stage, strategy.layout.numel
    base = model_state_bytes(stage, numel, n, kind, grad_size, 0)
    chunked = 8 if isinstance(updater.optimizer, torch.optim.AdamW) else 0
    masters = 4 if strategy.masters is not None else 0
    per_rank = n if stage >= 1 else 1
    optimizer = ((numel - matrices.numel) * chunked + numel * masters) / per_rank
    return base.params + base.grads + optimizer + 4 * matrices.formula_state_elements
