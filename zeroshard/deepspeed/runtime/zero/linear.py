"""``deepspeed.runtime.zero.linear``: ``zero3_linear_wrap``.

DeepSpeed routes a stage-3 linear layer through its own autograd function so that backward can find
a weight whose storage was released after forward.  Here the weight autograd saved is a view into its
bucket's buffer, which stage 3 gathers again before the backward that reads it ([Note: releasing
memory that autograd still points at] in sharding/stage3/sharded_params.py), so torch's own linear
computes the same values and gradients, and holds no more memory.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["zero3_linear_wrap"]


def zero3_linear_wrap(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``input @ weight.T + bias``: torch's linear, for a weight that stage 3 shards as for any other."""
    return F.linear(input, weight, bias)
