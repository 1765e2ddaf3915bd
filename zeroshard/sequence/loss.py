"""The loss over sequences split across a sequence-parallel group: the mean over the whole sequences'
counted tokens (labels other than -100), whatever share of them each rank holds.

[Note: a loss over the group's counted tokens]
Each rank holds a slice of the sequences, and the slices need not count the same number of tokens: a
prompt masked with -100 can lie wholly in one rank's slice.  The mean of the ranks' own means is then
not the mean over the sequence, and a rank counting no token has no mean at all.  So each rank gives its
sum and its count, both are summed over the group, and every rank's loss is the same quotient: the mean
one process computes on the whole sequences.  The sum goes through an all-reduce whose backward is an
all-reduce of the gradients, so a rank's sum receives the gradient of every rank's quotient: P times
``1 / count``.  Every rank's backward thus yields P times its share of the gradient of the mean, and the
engine's average over the ``dp x sp`` ranks (see [Note: the loss and the gradient average under
sequence parallelism] in sequence/layer.py) divides the P out again: the gradient is that of the mean
over each data-parallel index's counted tokens, averaged over the data-parallel indices, as data
parallelism averages its ranks' losses.  DeepSpeed's tutorial writes the same with a differentiable
all-gather of the ranks' means weighted by their counts, which agrees wherever every rank counts a token.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..distributed.collectives import Collectives
from .groups import sequence_collectives

__all__ = ["sequence_loss", "combine_sequence_losses"]

IGNORE_INDEX = -100


def sequence_loss(logits: Tensor, shift_labels: Tensor, group: Any = None, ignore_index: int = IGNORE_INDEX
                  ) -> Tensor:
    """Cross-entropy of ``logits`` ``[b, s/P, vocab]`` against ``shift_labels`` ``[b, s/P]`` (the adapter's:
    already shifted), the mean over the group's counted tokens ([Note: a loss over the group's counted
    tokens]); computed in fp32.  ``group``: the sequence-parallel process group (None: the live engine's)."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    labels = shift_labels.reshape(-1).to(flat.device)
    total = torch.nn.functional.cross_entropy(flat, labels, ignore_index=ignore_index, reduction="sum")
    return combine_sequence_losses(total, (labels != ignore_index).sum(), group)


def combine_sequence_losses(loss_sum: Tensor, count: Any, group: Any = None) -> Tensor:
    """``sum of loss_sum / sum of count`` over the sequence-parallel group (None: the live engine's),
    the same on every rank of it, differentiable in ``loss_sum``; a group counting no token gives 0.
    Without a sequence group, this rank's ``loss_sum / count``."""
    count = torch.as_tensor(count, device=loss_sum.device)
    comm: Optional[Collectives] = sequence_collectives(group, loss_sum.device)
    if comm is None or comm.world.world_size == 1:
        return loss_sum / count.clamp(min=1).to(loss_sum.dtype)
    total, counted = _SumOverGroup.apply(comm, loss_sum, count)
    return total / counted.clamp(min=1).to(total.dtype)


class _SumOverGroup(torch.autograd.Function):
    """``(loss_sum, count)`` summed over the group in one all-reduce (fp64: counts stay exact); the sum's
    gradient summed over the group in the backward."""

    @staticmethod
    def forward(ctx: Any, comm: Collectives, loss_sum: Tensor,  # type: ignore[override]
                count: Tensor) -> tuple[Tensor, Tensor]:
        ctx.comm = comm
        both = torch.stack([loss_sum.detach().double(), count.double()])
        comm.all_reduce(both, "sequence_loss")
        counted = both[1].to(loss_sum.dtype)
        ctx.mark_non_differentiable(counted)
        return both[0].to(loss_sum.dtype), counted

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _: Any) -> tuple[None, Tensor, None]:  # type: ignore[override]
        grad = grad.detach().clone().contiguous()
        ctx.comm.all_reduce(grad, "sequence_loss_grad")
        return None, grad, None
