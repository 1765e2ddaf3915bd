"""How DeepSpeed's AutoTP split each parameter over the tensor-parallel ranks, as its checkpoints
describe it: the ``universal_checkpoint_info`` patterns, fused sub-parameters and their per-rank widths.

[Note: AutoTP's layout in a checkpoint]
An AutoTP checkpoint holds one slice of every split parameter per tensor-parallel rank, and its
``universal_checkpoint_info`` says how the slices join: by name patterns, a parameter is replicated
(every rank holds it whole), averaged, row-parallel (joined along dim 1), a fused container of
sub-parameters (q/k/v of one linear: each rank holds a piece of *every* sub-parameter, so the slices
interleave), or column-parallel by default (dim 0).  A fused parameter's sub-parameter sizes sit at its
``partition_dim`` in ``shape``; since version 0.4 they are widths (a tuple) and ``sub_param_shard_widths``
records each rank's share of each sub-parameter, which is how grouped-query heads split unevenly.  Older
metadata put the *count* of equal sub-parameters there (``(3, -1)``) and recorded no widths, so only an
even split can be rebuilt from it: an uneven one is refused, never guessed, because a guessed offset
moves rows between q, k and v without any error.  Joining (conversion) and cutting (restore) use the
same widths, computed here once, so the two directions cannot disagree.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from ..constants import (AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS, PARAMETER_TO_AVERAGE_PATTERNS,
                         PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0, PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
                         PARAMETER_WITH_SUB_PARAMS, SUB_PARAM_SHARD_WIDTHS, TP_REPLICATED_PARAMETER_PATTERNS,
                         UNIVERSAL_CHECKPOINT_VERSION_KEY, VOCABULARY_PARAMETER_PATTERNS)
from ..format import CheckpointError

__all__ = ["SubparamShape", "TpLayoutError", "TpConversionUnsupported", "TpMergeRules", "check_conversion_support",
           "even_or_recorded_widths", "resolve_placeholder", "WIDTHS_VERSION"]

#: the universal-checkpoint version from which fused parameters record their per-rank widths
WIDTHS_VERSION = 0.4


class TpLayoutError(CheckpointError, AssertionError):
    """A tensor-parallel layout the checkpoint's metadata does not describe consistently (an
    ``AssertionError`` too, as DeepSpeed's converter raises for the same checks)."""


class TpConversionUnsupported(CheckpointError, ValueError):
    """The checkpoint marks parameters whose AutoTP layout cannot be joined (a ``ValueError`` too, as in
    DeepSpeed)."""


@dataclass
class SubparamShape:
    """DeepSpeed's ``SubparamShape``: the parameters matching ``patterns`` are fused containers whose
    ``shape[partition_dim]`` gives the sub-parameters' sizes (see [Note: AutoTP's layout in a checkpoint])."""

    patterns: list[str]
    shape: tuple[Union[tuple[int, ...], int], ...]
    partition_dim: int


def check_conversion_support(info: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose ``universal_checkpoint_info`` marks parameters AutoTP could not describe."""
    unsupported = info.get(AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS) or {}
    if unsupported:
        details = ", ".join(f"{pattern}: {reason}" for pattern, reason in sorted(unsupported.items()))
        raise TpConversionUnsupported(f"AutoTP universal checkpoint conversion is not supported for {details}")


def even_or_recorded_widths(sizes: Sequence[int], recorded: Optional[Sequence[Sequence[int]]], tp_degree: int,
                            version: float, what: str) -> list[list[int]]:
    """Each sub-parameter's width on each rank: the ``recorded`` widths from version 0.4 on, an even split
    before (refused where a size does not divide), checked against ``sizes`` either way."""
    if version < WIDTHS_VERSION:
        uneven = [size for size in sizes if size % tp_degree]
        if uneven:
            raise TpLayoutError(f"{what}: sub-parameter sizes {uneven} are not divisible by tp_world_size "
                                f"{tp_degree}, and metadata of version {version} records no "
                                f"{SUB_PARAM_SHARD_WIDTHS}, so the uneven layout cannot be rebuilt")
        return [[size // tp_degree] * tp_degree for size in sizes]
    if recorded is None:
        raise TpLayoutError(f"{what}: universal checkpoint version {version} records no {SUB_PARAM_SHARD_WIDTHS}")
    widths = [list(w) for w in recorded]
    if len(widths) != len(sizes):
        raise TpLayoutError(f"{what}: {len(widths)} shard width entries for {len(sizes)} sub-parameters")
    for size, per_rank in zip(sizes, widths):
        if len(per_rank) != tp_degree or sum(per_rank) != size:
            raise TpLayoutError(f"{what}: shard widths {per_rank} do not split a sub-parameter of {size} over "
                                f"{tp_degree} ranks")
    return widths


def resolve_placeholder(shape: Sequence[int], numel: int, what: str) -> list[int]:
    """``shape`` with its one ``-1`` (if any) replaced by the size that makes ``numel`` elements."""
    holes = [i for i, d in enumerate(shape) if d < 0]
    if not holes:
        return list(shape)
    known = math.prod(d for d in shape if d >= 0)
    if len(holes) > 1 or known <= 0 or numel % known:
        raise TpLayoutError(f"{what}: shape {list(shape)} cannot describe {numel} elements")
    out = list(shape)
    out[holes[0]] = numel // known
    return out


class TpMergeRules:
    """The join rule of each parameter name under one checkpoint's ``universal_checkpoint_info``, and the
    patterns no name has used yet (a converter's strict mode refuses patterns that matched nothing)."""

    def __init__(self, info: Mapping[str, Any]) -> None:
        self.version = float(info.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0))
        self.replicated: list[str] = list(info.get(TP_REPLICATED_PARAMETER_PATTERNS, []))
        self.averaged: list[str] = list(info.get(PARAMETER_TO_AVERAGE_PATTERNS, []))
        self.row_parallel: list[str] = list(info.get(PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, []))
        self.vocabulary: list[str] = list(info.get(VOCABULARY_PARAMETER_PATTERNS, []))
        self.two_halves: list[str] = list(info.get(PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0, []))
        self.fused = [SubparamShape(**spec) for spec in info.get(PARAMETER_WITH_SUB_PARAMS, [])]
        self.widths: dict[str, Any] = dict(info.get(SUB_PARAM_SHARD_WIDTHS, {}))
        self.original_vocab_size: Optional[int] = info.get("original_vocab_size")
        self.unmatched: set[str] = set(self.replicated + self.averaged + self.row_parallel + self.vocabulary
                                       + self.two_halves)
        self.unmatched.update(p for fused in self.fused for p in fused.patterns)

    def matches(self, patterns: Iterable[str], name: str) -> bool:
        """Whether ``name`` matches one of ``patterns`` (more than one is an error); a match is used."""
        hits = [p for p in patterns if re.match(p, name)]
        if len(hits) > 1:
            raise TpLayoutError(f"{name}: matches more than one pattern {hits}")
        self.unmatched.difference_update(hits)
        return bool(hits)

    def fused_shape(self, name: str) -> tuple[Optional[SubparamShape], Optional[str]]:
        """The fused description ``name`` matches, with the pattern that matched."""
        for fused in self.fused:
            for pattern in fused.patterns:
                if re.match(pattern, name):
                    self.unmatched.discard(pattern)
                    return fused, pattern
        return None, None
