"""The global gradient norm over shards, and clipping by it.

The norm must be the one ``torch.nn.utils.clip_grad_norm_`` would give on the full, unsharded
gradients, identical on every rank: each rank sums the squares of the gradient chunks it owns, the
sums are added across ranks (one scalar all-reduce), and every rank takes the same square root.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ..distributed.collectives import Collectives


def global_grad_norm(grads: Sequence[torch.Tensor], comm: Optional[Collectives]) -> float:
    """L2 norm of all gradients; ``comm`` sums the squares across ranks when grads are sharded."""
    local = 0.0
    for g in grads:  # in fp32 whatever the gradient dtype: a 16-bit norm would round, or overflow
        local += float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2 if g.numel() else 0.0
    total = comm.all_reduce_scalar(local, "grad_norm") if comm is not None else local
    return math.sqrt(total)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor that brings the global norm down to ``max_norm`` (torch's formula); 1 when not clipping."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def clip_(grads: Sequence[torch.Tensor], coef: float) -> None:
    """Multiply gradients in place by ``coef`` (from :func:`clip_coefficient`)."""
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
