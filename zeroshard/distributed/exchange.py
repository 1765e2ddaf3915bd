"""The differentiable all-to-all: chunk r of a tensor to rank r, and back in the backward.

Expert parallelism sends tokens to their experts' ranks with it (experts/layer.py) and sequence
parallelism trades a sequence split for a head split with it (sequence/all_to_all.py); both go through
the collectives layer, so the bytes are counted in the engine's ledger under the caller's label (the
backward's under ``<label>_grad``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .collectives import Collectives

__all__ = ["exchange"]


class _AllToAll(torch.autograd.Function):
    """An all-to-all of equal chunks along the first dimension whose backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, comm: Collectives, label: str, values: Tensor) -> Tensor:  # type: ignore[override]
        ctx.comm, ctx.label = comm, label
        values = values.contiguous()  # before empty_like, which would keep a transposed input's strides
        out = torch.empty_like(values)
        comm.all_to_all(out, values, label)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, Tensor]:  # type: ignore[override]
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad, f"{ctx.label}_grad")
        return None, None, out


def exchange(comm: Collectives, values: Tensor, label: str) -> Tensor:
    """Chunk r of ``values`` (first dimension, ``comm``'s size equal parts) goes to rank r; returns the
    chunks received, in rank order; differentiable: the gradient goes back by the same exchange, each
    chunk to the rank it came from."""
    return _AllToAll.apply(comm, label, values)
