"""DeepSpeed's ``ZeROCheckpoint``: a checkpoint's ZeRO files laid out by pipeline x tensor x data rank,
and the files (and their merged state) each rank of the saved layout, or of a smaller one, reads.

[Note: merging ZeRO files for a smaller layout]
A rank of a contracted layout (see [Note: the 3D reshape maps] in
checkpoint/deepspeed_format/reshape_maps.py) reads several saved ZeRO files.  Their states are merged
entry by entry: tensors concatenated along their first dimension in the map's order, dictionaries key
by key, lists and tuples element by element, any other value, a scalar tensor too (an optimizer's
``step``, the same on every rank), taken from the first file.  A flat
partition's tail padding belongs to no parameter, so it is cut off each file's moments before the
concatenation (the recorded paddings are then zero), and each group's partition count becomes the
target's data degree.  Files are read as data (unpickle.py), never by running their pickles.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..constants import BASE_OPTIMIZER_STATE, GROUP_PADDINGS, OPTIMIZER_STATE_DICT, PARTITION_COUNT
from ..format import CheckpointError
from .layout_metadata import get_model_3d_descriptor, list_checkpoint_files
from .reshape_maps import meg_2d_parallel_map, model_3d_desc
from .unpickle import load_deepspeed_file

__all__ = ["ZeROCheckpoint", "merge_state"]


def merge_state(state_a: Any, state_b: Any, key_list: Sequence[str] = ()) -> Any:
    """``state_b`` merged after ``state_a`` (see [Note: merging ZeRO files for a smaller layout])."""
    where = ".".join(key_list) or "<top>"
    if type(state_a) is not type(state_b):
        raise CheckpointError(f"cannot merge {type(state_a).__name__} with {type(state_b).__name__} at {where}")
    if isinstance(state_a, (dict, OrderedDict)):
        merged = type(state_a)()
        for key, value in state_b.items():
            merged[key] = merge_state(state_a[key], value, [*key_list, str(key)]) if key in state_a else value
        return merged
    if isinstance(state_a, (list, tuple)):
        if len(state_a) != len(state_b):
            raise CheckpointError(f"cannot merge lists of lengths {len(state_a)} and {len(state_b)} at {where}")
        return type(state_a)(merge_state(a, b, [*key_list, str(i)]) for i, (a, b) in enumerate(zip(state_a, state_b)))
    if torch.is_tensor(state_a) and state_a.dim() > 0:
        return torch.cat([state_a, state_b], 0)
    return state_a


def _optimizer_entry(state: dict[str, Any], key: str) -> Any:
    optimizer = state.get(OPTIMIZER_STATE_DICT)
    return optimizer.get(key) if isinstance(optimizer, dict) else None


def _strip_paddings(state: dict[str, Any]) -> None:
    """Cut each group's tail padding off its moments (``step`` and non-tensors kept)."""
    paddings = _optimizer_entry(state, GROUP_PADDINGS)
    base = _optimizer_entry(state, BASE_OPTIMIZER_STATE)
    groups = base.get("state") if isinstance(base, dict) else None
    if not paddings or not isinstance(groups, dict):
        return
    for group, moments in groups.items():
        padding = paddings[group]
        for name, value in list(moments.items()):
            if padding and name != "step" and torch.is_tensor(value):
                moments[name] = value.narrow(0, 0, value.numel() - padding).clone()


class ZeROCheckpoint:
    """The ZeRO files of the DeepSpeed checkpoint in folder ``dir``, mapped onto a target layout (the saved
    one until :meth:`reshape`)."""

    def __init__(self, dir: str, source_3d: Optional[model_3d_desc] = None) -> None:  # noqa: A002
        self.dir = str(dir)
        self.file_list = list_checkpoint_files(self.dir).zero_files
        self.num_files = len(self.file_list)
        if not self.file_list:
            raise CheckpointError(f"No ZeRO files found in {self.dir}")
        self.src_3d = get_model_3d_descriptor(self.dir) if source_3d is None else source_3d
        self.target_3d = model_3d_desc(self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree)
        self._3d_file_map: list[meg_2d_parallel_map] = self.src_3d.reshape(self.target_3d)

    def get_src_world_size(self) -> int:
        return self.src_3d.world_size()

    def get_src_tp_degree(self) -> int:
        return self.src_3d.tp_degree

    def get_src_pp_degree(self) -> int:
        return self.src_3d.pp_degree

    def get_src_dp_degree(self) -> int:
        return self.src_3d.dp_degree

    def reshape(self, target_3d_desc: model_3d_desc) -> None:
        """Map the files onto ``target_3d_desc`` (each degree a divisor of the saved one)."""
        self._3d_file_map = self.src_3d.reshape(target_3d_desc)
        self.target_3d = target_3d_desc

    def get_file_indices_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[int]:
        if not 0 <= dp_index < len(self._3d_file_map):
            raise CheckpointError(f"DP index {dp_index} >= DP degree {len(self._3d_file_map)}")
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        """The ZeRO files the target rank (``pp_index``, ``tp_index``, ``dp_index``) reads, in merge order."""
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def get_state_for_rank(self, pp_index: int, tp_index: int, dp_index: int, keys_to_ignore: Sequence[str] = (),
                           strip_tensor_paddings: bool = True) -> dict[str, Any]:
        """The merged state of the rank's files (see [Note: merging ZeRO files for a smaller layout])."""
        merged: Optional[dict[str, Any]] = None
        for file in self.get_files_for_rank(pp_index, tp_index, dp_index):
            state = load_deepspeed_file(Path(file))
            for key in keys_to_ignore:
                state.pop(key, None)
            if strip_tensor_paddings:
                _strip_paddings(state)
            merged = state if merged is None else merge_state(merged, state)
        if merged is None:
            raise CheckpointError(f"{self.dir}: no ZeRO file for rank ({pp_index}, {tp_index}, {dp_index})")
        counts = _optimizer_entry(merged, PARTITION_COUNT)
        if counts:
            merged[OPTIMIZER_STATE_DICT][PARTITION_COUNT] = [self.target_3d.dp_degree] * len(counts)
        paddings = _optimizer_entry(merged, GROUP_PADDINGS)
        if strip_tensor_paddings and paddings:
            merged[OPTIMIZER_STATE_DICT][GROUP_PADDINGS] = [0] * len(paddings)
        return merged

    def print_3d_index_map(self, tag: Optional[str] = None) -> None:
        if tag:
            print(f"3D index map: {tag}")
        for dp_index, cells in enumerate(self._3d_file_map):
            cells.print_data(f"dp = {dp_index}")
