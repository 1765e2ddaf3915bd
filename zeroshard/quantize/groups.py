"""A tensor quantised to int8 as a number of equal groups (DeepSpeed's quantiser interface: ``groups`` rather
than a block size), over the block quantiser (blocks.py).

[Note: equal groups]
DeepSpeed's quantiser is asked for a number of groups and returns one scale per group, and its
dequantiser is given only the values and the scales: the group size must follow from the two counts.
So every group has the same size, ``numel / groups``, and a count that does not divide the tensor is
refused.  Without a count, the fewest groups that divide the tensor into groups of at most
:data:`TARGET_GROUP_SIZE` elements are taken (a tensor of prime size then has one element per group:
exact, never wrong).
"""

from __future__ import annotations

from typing import Optional

import torch

from .blocks import dequantise, quantise
from .format import BlockFormat, QuantisationError

__all__ = ["TARGET_GROUP_SIZE", "group_count", "quantise_groups", "dequantise_groups"]

#: the largest group chosen when no count is given (DeepSpeed's quantiser aims below 8000 elements too)
TARGET_GROUP_SIZE = 8000


def group_count(numel: int, target: int = TARGET_GROUP_SIZE) -> int:
    """The fewest groups that cut ``numel`` elements into equal groups of at most ``target``."""
    if numel < 1:
        raise QuantisationError("an empty tensor has no groups to quantise")
    groups = -(-numel // target)
    while numel % groups:
        groups += 1
    return groups


def _format(numel: int, groups: int) -> BlockFormat:
    if groups < 1 or numel % groups:
        raise QuantisationError(f"{numel} elements do not split into {groups} equal groups (see [Note: equal "
                                f"groups] in quantize/groups.py)")
    return BlockFormat(8, numel // groups)


def quantise_groups(values: torch.Tensor, groups: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (read flat) as (int8 values, one per element; fp32 scales, one per group), symmetric
    (see [Note: symmetric blocks of any size] in quantize/blocks.py)."""
    numel = values.numel()
    fmt = _format(numel, group_count(numel) if groups is None else groups)
    payload, scales = quantise(values, fmt)
    return payload.view(torch.int8), scales


def dequantise_groups(quantised: torch.Tensor, scales: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The flat values ``quantise_groups`` gave ``quantised`` and ``scales`` for, in ``dtype``."""
    numel = quantised.numel()
    fmt = _format(numel, scales.numel())
    return dequantise(quantised.reshape(-1).view(torch.uint8), scales.float(), numel, fmt).to(dtype)
