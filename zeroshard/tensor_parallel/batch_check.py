"""Every rank of a tensor-parallel group must compute on the same batch; a group whose ranks were
given different ones is stopped with a named error on every rank of the job.

[Note: one batch per tensor-parallel group]
The ranks of a tensor-parallel group compute one model on one batch, each its share of the layers: a
rank fed another batch would silently combine partial results of two batches (DeepSpeed asserts it).
Before each forward every rank contributes a fingerprint of its tensor inputs (element count, sum and
sum of squares, in float64) to one all-gather over the whole job, so that every rank sees every
group's and all raise together, naming the ranks that differ, instead of the others going on into
collectives the stopped ones never join.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed.collectives import Collectives


class TensorParallelBatchError(RuntimeError):
    """The ranks of a tensor-parallel group were given different batches."""


def _fingerprint(args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> torch.Tensor:
    values = torch.zeros(3, dtype=torch.float64, device=device)
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            data = value.detach().to(device=device, dtype=torch.float64)
            values += torch.stack([torch.tensor(float(data.numel()), dtype=torch.float64, device=device),
                                   data.sum(), data.square().sum()])
    return values


def check_batches(model: nn.Module, job: Collectives, size: int) -> Any:
    """Check, before each forward of ``model``, that every tensor-parallel group (``size`` neighbouring
    ranks of ``job``) was given one batch; returns the hook's handle."""
    def check(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        n = job.world.world_size
        mine = _fingerprint(args, kwargs, job.world.device)
        every = torch.empty(3 * n, dtype=torch.float64, device=job.world.device)
        job.all_gather_rows(every, mine, "tensor_parallel_batch_check")
        rows = every.view(n, 3).cpu()
        differing = [list(range(g, g + size)) for g in range(0, n, size)
                     if not all(torch.equal(rows[g], rows[r]) for r in range(g, g + size))]
        if differing:
            raise TensorParallelBatchError(
                f"the ranks of tensor-parallel group(s) {differing} were given different batches: every rank of a "
                f"group computes its share of one batch; give them the same samples (one data-parallel rank's "
                f"loader each)")
    return model.register_forward_pre_hook(check, with_kwargs=True)
