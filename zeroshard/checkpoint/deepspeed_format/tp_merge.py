"""One parameter of a tensor-parallel DeepSpeed checkpoint joined whole: its ranks' slices of each state
put together by the rule its checkpoint gives it (see [Note: AutoTP's layout in a checkpoint] in
checkpoint/deepspeed_format/tp_layout.py), and written as a universal checkpoint's parameter folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence, Union

import torch

from ..constants import CAT_DIM, PARAM, PARAM_N_SUB_PARAMS, SUB_PARAM_SHAPE, VOCAB_TENSOR
from .fragments import Shape, merge_zero_shards
from .pickler import save_deepspeed_file
from .tp_layout import SubparamShape, TpLayoutError, TpMergeRules, even_or_recorded_widths, resolve_placeholder

__all__ = ["join_slices", "merge_tp_slices", "STATES"]

#: the states a universal parameter folder holds besides the step
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _fused_sizes(fused: SubparamShape, slices: Sequence[torch.Tensor], tp_degree: int, rules: TpMergeRules,
                 pattern: str, name: str) -> tuple[tuple[int, ...], SubparamShape, list[list[int]]]:
    """The sub-parameters' sizes, the description written with them (sizes, never a count) and each one's
    width on each rank."""
    dim = fused.partition_dim
    spec = fused.shape[dim]
    if isinstance(spec, (tuple, list)):
        sizes, described = tuple(spec), fused
    else:  # a count of equal sub-parameters (metadata before widths were recorded)
        if any(s.dim() <= dim for s in slices):
            raise TpLayoutError(f"{name}: a sub-parameter count needs the ranks' shapes, but the slices are flat")
        full = sum(s.shape[dim] for s in slices)
        if spec <= 0 or full % spec:
            raise TpLayoutError(f"{name}: {spec} sub-parameters do not divide dimension {dim} of size {full}")
        sizes = (full // spec, ) * spec
        shape = list(fused.shape)
        shape[dim] = sizes
        described = SubparamShape(patterns=fused.patterns, shape=tuple(shape), partition_dim=dim)
    recorded = rules.widths.get(pattern)
    widths = even_or_recorded_widths(sizes, recorded, tp_degree, rules.version, name)
    return sizes, described, widths


def _join_fused(fused: SubparamShape, slices: Sequence[torch.Tensor], tp_degree: int, rules: TpMergeRules,
                pattern: str, name: str) -> tuple[torch.Tensor, SubparamShape]:
    """Each sub-parameter's pieces from every rank, in rank order, then the sub-parameters in order."""
    dim = fused.partition_dim
    sizes, described, widths = _fused_sizes(fused, slices, tp_degree, rules, pattern, name)
    logical = [sum(d) if isinstance(d, (tuple, list)) else d for d in fused.shape]
    logical[dim] = sum(sizes)
    logical = resolve_placeholder(logical, sum(s.numel() for s in slices), name)
    views = []
    for rank, piece in enumerate(slices):
        shape = list(logical)
        shape[dim] = sum(w[rank] for w in widths)
        if torch.Size(shape).numel() != piece.numel():
            raise TpLayoutError(f"{name}: tp rank {rank} holds {piece.numel()} elements, but its recorded shard "
                                f"widths describe a shape of {tuple(shape)}")
        views.append(piece.reshape(shape))
    offsets = [0] * len(views)
    parts = []
    for per_rank in widths:
        for rank, view in enumerate(views):
            parts.append(view.narrow(dim, offsets[rank], per_rank[rank]))
            offsets[rank] += per_rank[rank]
    return torch.cat(parts, dim=dim), described


def join_slices(rules: TpMergeRules, name: str, slices: Sequence[torch.Tensor], tp_degree: int) -> dict[str, Any]:
    """The universal entry of one state of ``name`` from its ranks' ``slices``: ``param`` and the
    entries that say how it was joined (``cat_dim``, ``sub_param_shape``, ...)."""
    entry: dict[str, Any] = {}
    fused, pattern = rules.fused_shape(name)
    if rules.matches(rules.replicated, name):
        if any(not slices[0].equal(other) for other in slices[1:]):
            raise TpLayoutError(f"{name}: marked replicated, but its tensor-parallel ranks hold different values")
        param = slices[0]
    elif rules.matches(rules.averaged, name):
        param = sum(slices[1:], slices[0]) / len(slices)
    elif rules.matches(rules.two_halves, name):
        halves = [s.chunk(2, dim=0) for s in slices]
        param = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        entry[CAT_DIM], entry[PARAM_N_SUB_PARAMS] = 0, 2
    elif fused is not None and pattern is not None:
        param, entry[SUB_PARAM_SHAPE] = _join_fused(fused, slices, tp_degree, rules, pattern, name)
    else:
        entry[CAT_DIM] = 1 if rules.matches(rules.row_parallel, name) else 0
        param = torch.cat(list(slices), dim=entry[CAT_DIM])
    if rules.matches(rules.vocabulary, name):
        if rules.original_vocab_size is None:
            raise TpLayoutError(f"{name}: a vocabulary parameter, but the checkpoint records no original_vocab_size")
        param = param[:rules.original_vocab_size]
        entry[VOCAB_TENSOR] = True
    entry[PARAM] = param
    return entry


def merge_tp_slices(uc_info: Mapping[str, Any], folder: Union[str, Path], slice_folder: Union[str, Path],
                    tp_degree: int, name_and_shapes: tuple[str, Sequence[Shape]]) -> set[str]:
    """DeepSpeed's ``merge_tp_slices``: parameter ``name``'s fragments under ``slice_folder`` (see [Note:
    the fragment folder] in checkpoint/deepspeed_format/fragments.py), joined into ``folder/<name>/``
    (``fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt``).  Returns the patterns of ``uc_info``
    this parameter did not use."""
    name, shapes = name_and_shapes
    rules = TpMergeRules(uc_info)
    source, target = Path(slice_folder) / name, Path(folder) / name
    steps = merge_zero_shards(source, "step", tp_degree, shapes)
    if steps:
        target.mkdir(parents=True, exist_ok=True)
        save_deepspeed_file(steps[0], target / "step.pt")
    for state in STATES:
        slices = merge_zero_shards(source, state, tp_degree, shapes)
        if not slices:
            # ZeRO keeps no optimizer state for a parameter that never had a gradient; its weight is
            # written from the model file instead
            continue
        target.mkdir(parents=True, exist_ok=True)
        save_deepspeed_file(join_slices(rules, name, slices, tp_degree), target / f"{state}.pt")
    return rules.unmatched
