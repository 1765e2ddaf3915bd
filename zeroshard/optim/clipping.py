"""The global gradient norm over shards, and clipping by it.

The norm must be the one ``torch.nn.utils.clip_grad_norm_`` would give on the full, unsharded
gradients, identical on every rank: each rank sums the squares of the gradient chunks it owns, the
sums are added across ranks (one scalar all-reduce), and every rank takes the same square root.

[Note: the norm stays on the device]
Each bucket's norm is a device tensor, and the squares are summed on the device in float64, in bucket
order, into one tensor that is all-reduced once: reading a bucket's norm on the host (``float()``)
would make the host wait for the GPU at every bucket, so that nothing is queued ahead of the GPU while
it computes the next.  The engine reads the finished norm once per optimizer step (see [Note: one
host read per optimizer step] in engine/optimizer_step.py).  The arithmetic is the one of a host sum of
doubles: each bucket's fp32 norm widened to float64 and squared, added one bucket after another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..distributed.collectives import Collectives


@dataclass(frozen=True)
class ExpertsNorm:
    """Expert parallelism where each rank holds whole gradients (stage 0): a rank holds only its own
    experts' gradients, so the squares of the expert buckets (``buckets``, by index) are summed over
    the ranks that exchange tokens (``comm``), which hold the other experts."""

    buckets: frozenset[int]
    comm: Collectives


def global_grad_norm(grads: Sequence[torch.Tensor], comm: Optional[Collectives],
                     device: Optional[torch.device] = None, experts: Optional[ExpertsNorm] = None) -> torch.Tensor:
    """L2 norm of all gradients (one per bucket, in bucket order), a float64 tensor of one element on
    the gradients' device (``device`` when there are none); ``comm`` sums the squares across ranks
    when grads are sharded, ``experts`` the experts' squares when they are not."""
    where = grads[0].device if grads else device if device is not None else torch.device("cpu")
    total = torch.zeros(1, dtype=torch.float64, device=where)
    spread = torch.zeros(1, dtype=torch.float64, device=where)  # experts held on other ranks too
    apart = experts if comm is None else None
    for index, g in enumerate(grads):  # in fp32 whatever the gradient dtype: a 16-bit norm would round, or overflow
        if g.numel():
            into = spread if apart is not None and index in apart.buckets else total
            into.add_(torch.linalg.vector_norm(g, dtype=torch.float32).double().square())
    if apart is not None:
        apart.comm.all_reduce(spread, "grad_norm_experts")
        total.add_(spread)
    if comm is not None:
        comm.all_reduce(total, "grad_norm")
    return total.sqrt_()


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
