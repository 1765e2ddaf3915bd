"""Non-finite gradients in any precision: skip the step on every rank, say where they came from, and
stop with a named error when they keep coming.

[Note: non-finite gradients]
One NaN on one rank becomes NaN on every rank after the gradient reduction, and one optimizer step
with it turns every parameter NaN, silently.  The global gradient norm, which every step computes
anyway (summed over ranks), is non-finite exactly when some gradient element is, so it is the
check: every rank sees the same norm and skips the same step (parameters, optimizer state and LR
schedule untouched), as fp16's loss scaler already does for overflows.  Finding *where* costs more
and is done only on the rare skipped step: one small all-gather of each rank's "my loss was not
finite" flag names the rank(s) that produced it; after ``max_consecutive_skips`` skips in a row
(training is not recovering) a second pass finds the first parameter, in model order, whose owned
gradient holds a non-finite element, and the error names both.  Under fp16 a non-finite norm is an
overflow and the loss scaler's rules (halve the scale, ``LossScaleError`` at ``min_loss_scale``)
govern instead.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..distributed.collectives import Collectives
from ..sharding.layout import BucketLayout, ShardRanks


class NonFiniteGradientError(RuntimeError):
    """Optimizer steps kept meeting non-finite gradients; names the first rank and parameter."""


def ranks_with_nonfinite_loss(comm: Collectives, mine_was: bool) -> list[int]:
    """Which ranks saw a NaN or infinite loss since the last step (one all-gather of a flag per rank)."""
    world = comm.world
    if not world.is_distributed:
        return [0] if mine_was else []
    mine = torch.tensor([1.0 if mine_was else 0.0], device=world.device)
    flags = torch.zeros(world.world_size, device=world.device)
    comm.all_gather(flags, mine, "nonfinite_loss_ranks")
    return [r for r, f in enumerate(flags.tolist()) if f]


def first_nonfinite_parameter(comm: Collectives, ranks: ShardRanks, buckets: Sequence[BucketLayout],
                              owned_grads: Sequence[torch.Tensor], names: Sequence[str]) -> Optional[str]:
    """The first parameter (in the order of ``names``) with a non-finite element in any rank's owned
    part of its gradient (``ranks``: this rank's chunk of each bucket); ``None`` if there is none now."""
    first = len(names)
    for bucket, grad in zip(buckets, owned_grads):
        start = bucket.chunk_start(grad.numel(), ranks.of(bucket))
        for slot in bucket.slots:
            lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, start + grad.numel())
            if lo < hi and slot.index < first and not bool(torch.isfinite(grad[lo - start: hi - start]).all()):
                first = slot.index
    if comm.world.is_distributed:
        first = int(comm.all_reduce_scalar(float(first), "nonfinite_parameter", op=dist.ReduceOp.MIN))
    return names[first] if first < len(names) else None
