"""The working folder of a tensor-parallel universal conversion: each rank's fragment of each parameter's
state, written as it is cut out of the flat ZeRO partitions and read back per tensor-parallel rank.

[Note: the fragment folder]
DeepSpeed's converter, whose layout this is, cuts every optimizer file into
``<folder>/<parameter>/<tp rank>/<state>.<dp rank>`` (each a flat tensor, or the step), then joins the
data-parallel fragments of one tensor-parallel rank end to end and reshapes them to that rank's own
shape: ranks of an uneven split hold slices of different shapes.  A rank that holds none of a parameter
(more ranks than key/value heads) writes no fragment, so its empty slice is put back in its place: the
joins pair slices with per-rank widths by position, and a missing one would move every later rank onto
its neighbour's widths.  A rank whose recorded shape is not empty but wrote nothing lost data, which is
refused.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from .pickler import save_deepspeed_file
from .tp_layout import TpLayoutError
from .unpickle import load_deepspeed_file

__all__ = ["dump_fragment", "merge_zero_shards", "group_per_tp_shapes"]

Shape = Sequence[int]


def fragment_file(folder: Union[str, Path], name: str, tp_index: int, state: str, dp_index: int) -> Path:
    """Where rank (``tp_index``, ``dp_index``)'s fragment of ``name``'s ``state`` goes."""
    return Path(folder) / name / str(tp_index) / f"{state}.{dp_index:02d}"


def dump_fragment(folder: Union[str, Path], tp_index: int, dp_index: int, state: str, flat: Any, name: str,
                  offset: int, numel: int) -> None:
    """Write ``flat[offset:offset + numel]`` (the step as it is) as one fragment."""
    path = fragment_file(folder, name, tp_index, state, dp_index)
    path.parent.mkdir(parents=True, exist_ok=True)
    if state != "step" and torch.is_tensor(flat):
        flat = flat.narrow(0, offset, numel).clone()
    save_deepspeed_file(flat, path)


def _rank_fragments(folder: Path, state: str) -> list[Path]:
    pattern = re.compile(re.escape(state) + r"\.(\d+)$")
    found = []
    for path in folder.glob(f"{state}.*") if folder.is_dir() else []:
        match = pattern.match(path.name)
        if match is None:
            raise TpLayoutError(f"{path}: not a fragment name (<state>.<dp rank>)")
        found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def merge_zero_shards(param_folder: Union[str, Path], state: str, tp_degree: int,
                      slice_shapes: Optional[Sequence[Shape]] = None) -> list[Any]:
    """Each tensor-parallel rank's slice of one parameter's ``state``, its data-parallel fragments joined
    (in ``slice_shapes[rank]``'s shape where given; see [Note: the fragment folder])."""
    slices: list[Any] = []
    missing: list[tuple[int, int]] = []
    for tp_index in range(tp_degree):
        paths = _rank_fragments(Path(param_folder) / str(tp_index), state)
        if not paths:
            missing.append((tp_index, len(slices)))
            continue
        shards = [load_deepspeed_file(p) for p in paths]
        if state == "step":
            if any(s != shards[0] for s in shards):
                raise TpLayoutError(f"{param_folder}: the data-parallel ranks saved different steps")
            slices.append(shards[0])
            continue
        joined = torch.cat(shards, dim=0)
        slices.append(joined if slice_shapes is None else joined.reshape(tuple(slice_shapes[tp_index])))
    if missing and slice_shapes is not None and slices and torch.is_tensor(slices[0]):
        for tp_index, position in reversed(missing):
            shape = tuple(slice_shapes[tp_index])
            if math.prod(shape) != 0:
                raise TpLayoutError(f"{param_folder}: tensor-parallel rank {tp_index} wrote no fragment of "
                                    f"{state}, but its recorded shape {shape} is not empty")
            slices.insert(position, torch.empty(shape, dtype=slices[0].dtype))
    return slices


def group_per_tp_shapes(shapes_by_file: Sequence[Mapping[str, Shape]], pp_degree: int,
                        tp_degree: int) -> dict[str, list[Optional[Shape]]]:
    """Each parameter's shape on each tensor-parallel rank, from the model files' shapes in DeepSpeed's
    order (pipeline-major: file ``pp * tp_degree + tp``); a parameter of some pipeline stages only is kept,
    and one stored by several stages (a tied weight) must have one shape."""
    per_tp: list[dict[str, Shape]] = []
    for tp in range(tp_degree):
        shapes: dict[str, Shape] = {}
        for pp in range(pp_degree):
            for name, shape in shapes_by_file[pp * tp_degree + tp].items():
                if name in shapes and shapes[name] != shape:
                    raise TpLayoutError(f"pipeline replicas of {name} on tp rank {tp} disagree on shape: "
                                        f"{shapes[name]} vs {shape}")
                shapes[name] = shape
        per_tp.append(shapes)
    names = {name for shapes in per_tp for name in shapes}
    return {name: [shapes.get(name) for shapes in per_tp] for name in names}
