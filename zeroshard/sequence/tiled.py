"""Tiled compute along the sequence (DeepSpeed's ALST ``TiledMLP`` and ``sequence_tiled_compute``): a
position-wise computation run on one tile of the sequence at a time, so that its intermediate
activations (an MLP's 4x-wide hidden layer, a vocabulary-wide row of logits) exist for one tile only.

[Note: a tiled computation's backward]
The forward runs each tile without autograd and keeps only its input; the backward runs each tile
again with autograd and takes the gradients of that tile's input and of the leaf tensors the tile used
(the parameters, found in the recomputed graph, so ZeRO-3's gathered parameters are the ones met) with
``torch.autograd.grad``.  Each leaf's gradients, summed over the tiles, reach it once, by one
``torch.autograd.backward`` on the leaves after the last tile: autograd accumulates each parameter's
gradient once, as an untiled computation would.  A parameter whose gradient arrived once per tile
would reach ZeRO's gradient hooks several times in one backward, and a bucket reduced after the first
tile would miss the rest.  ``compute_params`` (DeepSpeed's list of the parameters used) is therefore
not needed, and is accepted for DeepSpeed's signature only.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

__all__ = ["TiledMLP", "sequence_tiled_compute"]


class TiledMLP:
    """``TiledMLP.apply(fn, module, x, shards, compute_params)`` (DeepSpeed's call): ``fn(module, x)`` on
    ``shards`` tiles of ``x`` along its sequence dimension (``-2`` of ``[b, s, hidden]``), the results
    side by side; differentiable in ``x`` and whatever parameters ``fn`` uses ([Note: a tiled
    computation's backward]; ``compute_params`` is DeepSpeed's and not needed).  Every rank of a ZeRO-3 job
    must run the same number of tiles (each tile's recomputation gathers the parameters)."""

    @staticmethod
    def apply(fn: Callable[[nn.Module, Tensor], Tensor], module: nn.Module, x: Tensor, shards: int,
              compute_params: Optional[Sequence[Tensor]] = None) -> Tensor:
        del compute_params
        tiled: Tensor = _Tiled.apply(lambda part, _index: fn(module, part), int(shards), None, x.dim() - 2,
                                     x.dim() - 2, x)
        return tiled


def sequence_tiled_compute(fn: Callable[..., Tensor], seqlen: int, shards: int, kwargs_to_shard: dict[str, Any],
                           kwargs_to_pass: dict[str, Any], grad_requiring_tensor_key: str,
                           compute_params: Optional[Sequence[Tensor]] = None, output_unshard_dimension: int = 1,
                           output_reduction: Optional[str] = "mean") -> Tensor:
    """``fn(**tile_of_kwargs_to_shard, **kwargs_to_pass)`` on ``shards`` tiles along dimension 1 (of
    ``seqlen`` positions) of every tensor of ``kwargs_to_shard`` (DeepSpeed's signature); the outputs
    side by side along ``output_unshard_dimension`` (``output_reduction`` None), or their ``"sum"`` or
    ``"mean"``.  Differentiable in ``kwargs_to_shard[grad_requiring_tensor_key]`` and whatever parameters
    ``fn`` uses ([Note: a tiled computation's backward]; ``compute_params`` is DeepSpeed's and not needed)."""
    if output_reduction not in (None, "sum", "mean"):
        raise ValueError(f"sequence_tiled_compute: output_reduction must be None, 'sum' or 'mean', not "
                         f"{output_reduction!r}")
    x = kwargs_to_shard[grad_requiring_tensor_key]
    if x.shape[1] != seqlen:
        raise ValueError(f"sequence_tiled_compute: {grad_requiring_tensor_key!r} holds {x.shape[1]} positions along "
                         f"dimension 1, not seqlen={seqlen}")
    others = {k: v for k, v in kwargs_to_shard.items() if k != grad_requiring_tensor_key}
    bounds = _bounds(seqlen, shards)

    def run(part: Tensor, index: int) -> Tensor:
        start, stop = bounds[index]
        tiles = {k: v[:, start:stop] if torch.is_tensor(v) else v for k, v in others.items()}
        return fn(**{grad_requiring_tensor_key: part}, **tiles, **kwargs_to_pass)

    del compute_params
    tiled: Tensor = _Tiled.apply(run, len(bounds), output_reduction, 1, output_unshard_dimension, x)
    return tiled


def _bounds(length: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` tiles of ``length`` as (start, stop), the first ones a position longer when it does not
    divide; no empty tile."""
    if shards < 1:
        raise ValueError(f"a tiled computation needs at least one tile, not {shards}")
    size = -(-length // shards)
    return [(start, min(start + size, length)) for start in range(0, length, size)] or [(0, 0)]


class _Tiled(torch.autograd.Function):
    """The tiles' forward without autograd, and their backward by recomputation ([Note: a tiled
    computation's backward]).  ``run(tile, index)`` computes one tile."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., Tensor], shards: int, reduction: Optional[str],  # type: ignore[override]
                dim: int, out_dim: int, x: Tensor) -> Tensor:
        bounds = _bounds(x.shape[dim], shards)
        ctx.run, ctx.bounds, ctx.reduction, ctx.dim, ctx.out_dim = run, bounds, reduction, dim, out_dim
        ctx.save_for_backward(x)
        with torch.no_grad():
            outs = [run(x.narrow(dim, start, stop - start), i) for i, (start, stop) in enumerate(bounds)]
        ctx.sizes = [o.shape[out_dim] if reduction is None else 0 for o in outs]
        if reduction is None:
            return torch.cat(outs, dim=out_dim)
        total = torch.stack(outs).sum(0)
        return total / len(outs) if reduction == "mean" else total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        x_grads: list[Tensor] = []
        leaves: dict[int, Tensor] = {}
        sums: dict[int, Tensor] = {}
        offset = 0
        for i, (start, stop) in enumerate(ctx.bounds):
            part = x.narrow(ctx.dim, start, stop - start).detach().requires_grad_(x.requires_grad)
            if ctx.reduction is None:
                tile_grad = grad.narrow(ctx.out_dim, offset, ctx.sizes[i])
                offset += ctx.sizes[i]
            else:
                tile_grad = grad / len(ctx.bounds) if ctx.reduction == "mean" else grad
            with torch.enable_grad():
                out = ctx.run(part, i)
            used = [leaf for leaf in _leaves(out) if leaf is not part]
            grads = torch.autograd.grad(out, ([part] if x.requires_grad else []) + used, tile_grad, allow_unused=True)
            if x.requires_grad:
                first = grads[0]
                x_grads.append(first if first is not None else torch.zeros_like(part))
                grads = grads[1:]
            for leaf, g in zip(used, grads):
                if g is not None:
                    leaves[id(leaf)] = leaf
                    sums[id(leaf)] = g if id(leaf) not in sums else sums[id(leaf)] + g
        if sums:  # each leaf's gradient once
            torch.autograd.backward([leaves[k] for k in sums], list(sums.values()))
        x_grad = torch.cat(x_grads, dim=ctx.dim) if x.requires_grad else None
        return None, None, None, None, None, x_grad


def _leaves(out: Tensor) -> list[Tensor]:
    """The leaf tensors that need a gradient in ``out``'s graph, in the order first met."""
    found: dict[int, Tensor] = {}
    seen: set[int] = set()
    stack = [out.grad_fn] if out.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            found.setdefault(id(variable), variable)
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return list(found.values())
