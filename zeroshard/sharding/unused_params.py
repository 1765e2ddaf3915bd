"""``zero_optimization.ignore_unused_parameters: false``: a trainable parameter that got no gradient in
a backward is an error, raised on every rank of the job together.

[Note: every rank refuses an unused parameter together]
Which parameters a backward reaches is a rank's own: its data may skip a branch that another rank's
data takes.  A rank that raised alone would leave the others waiting in the next collective, so the
strategy first finishes the backward as it always does (a parameter with no gradient counts as zeros,
[Note: launching buckets in order] in sharding/strategy.py), every rank having issued the same
collectives, and then the ranks all-reduce one flag, "some parameter of mine got no gradient".  Where
any rank set it, the ranks exchange the names and every rank raises the same error, naming each rank's
parameters.  Only with the key false is the flag exchanged: one small all-reduce per backward.
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from ..distributed.collectives import Collectives

__all__ = ["UnusedParameterError", "refuse_unused_parameters"]


class UnusedParameterError(RuntimeError, AssertionError):
    """A trainable parameter got no gradient in a backward while ``ignore_unused_parameters`` is false
    (an ``AssertionError`` too, as DeepSpeed's check is: see [Note: argument errors that are also
    AssertionErrors] in errors.py)."""


def refuse_unused_parameters(comm: Collectives, unused: Sequence[str]) -> None:
    """Raise :class:`UnusedParameterError` on every rank of ``comm`` where any rank's backward left
    parameters ``unused`` (see [Note: every rank refuses an unused parameter together])."""
    flag = comm.all_reduce_scalar(1.0 if unused else 0.0, "unused_parameters.flag", op=dist.ReduceOp.MAX)
    if flag == 0.0:
        return
    names = comm.all_gather_json(list(unused), "unused_parameters.names")
    listed = "; ".join(f"rank {rank}: {', '.join(sorted(ranks_names))}" for rank, ranks_names in enumerate(names)
                       if ranks_names)
    raise UnusedParameterError(
        f"trainable parameters received no gradient in this backward ({listed}) while "
        f"zero_optimization.ignore_unused_parameters is false: use every trainable parameter in each forward, "
        f"freeze the unused ones (requires_grad=False), or set 'ignore_unused_parameters': true (their gradients "
        f"then count as zeros)")
