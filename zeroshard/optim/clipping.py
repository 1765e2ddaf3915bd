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
    for g in grads:
        local += float(torch.linalg.vector_norm(g)) ** 2 if g.numel() else 0.0
    total = comm.all_reduce_scalar(local, "grad_norm") if comm is not None else local
    return math.sqrt(total)


def clip_(grads: Sequence[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale gradients in place so that their global norm is at most ``max_norm`` (torch's formula)."""
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
