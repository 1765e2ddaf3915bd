"""DeepSpeed's ``DeepSpeedCheckpoint``: what one tag's folder of a DeepSpeed checkpoint holds, read as data.

[Note: DeepSpeed's checkpoint description]
DeepSpeed's class describes a checkpoint's files and its pipeline x tensor x data layout, and hands out
each rank's ZeRO files; its conversion tools (``ds_to_universal``) are built on it.  zeroshard's reads
the same files with its safe unpickling (unpickle.py), each model file once (the layout, the entries
the universal conversion checks, and the first file whole: iteration, arguments, checkpoint info), and
takes the layout from the files ([Note: a checkpoint's layout from its files] in
checkpoint/deepspeed_format/layout_metadata.py).  Asked for smaller degrees, it maps each rank of the
smaller layout onto the saved files it reads ([Note: the 3D reshape maps] in
checkpoint/deepspeed_format/reshape_maps.py) and merges them ([Note: merging ZeRO files for a smaller
layout] in checkpoint/deepspeed_format/zero_checkpoint.py); a larger degree would split a saved file
and is refused by name.  Training state at another data-parallel degree is what zeroshard's loader and
``zeroshard convert --to deepspeed`` produce, parameter by parameter.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ..format import CheckpointError
from .layout_metadata import descriptor_from_metadata, list_checkpoint_files, read_model_files
from .reshape_maps import meg_2d_parallel_map, model_3d_desc, reshape_meg_2d_parallel
from .zero_checkpoint import ZeROCheckpoint

__all__ = ["DeepSpeedCheckpoint"]


class DeepSpeedCheckpoint:
    """One tag's folder of a DeepSpeed checkpoint (see [Note: DeepSpeed's checkpoint description])."""

    def __init__(self, dir: str, tp_degree: Optional[int] = None, pp_degree: Optional[int] = None,  # noqa: A002
                 dp_degree: Optional[int] = None, final_layer_norm_idx: int = -1) -> None:
        self.dir = str(dir)
        self.final_layer_norm_idx = final_layer_norm_idx
        files = list_checkpoint_files(self.dir)
        self.file_list, self.layer_files = files.all_files, files.layer_files
        self.mp_rank_files, self.zero_files = files.model_files, files.zero_files
        if not self.mp_rank_files:
            raise CheckpointError(f"{self.dir}: no model states file (mp_rank_*_model_states.pt)")
        self.model_state_metadata, self.global_state = read_model_files(self.mp_rank_files)
        source = descriptor_from_metadata(self.file_list, self.zero_files, self.model_state_metadata)
        self.original_tp_degree, self.original_pp_degree = source.tp_degree, source.pp_degree
        self.original_dp_degree = source.dp_degree
        self.tp_degree = source.tp_degree if tp_degree is None else tp_degree
        self.pp_degree = source.pp_degree if pp_degree is None else pp_degree
        self.dp_degree = source.dp_degree if dp_degree is None else dp_degree
        target = model_3d_desc(self.pp_degree, self.tp_degree, self.dp_degree)
        valid, errors = source.can_reshape(target)
        if not valid:
            raise CheckpointError(f"{self.dir}: reshaping a DeepSpeed checkpoint saved at pipeline / tensor / data "
                                  f"degrees {source.pp_degree} / {source.tp_degree} / {source.dp_degree} to "
                                  f"pipeline degree {self.pp_degree} / tensor degree {self.tp_degree} / data "
                                  f"degree {self.dp_degree} is not done ({'; '.join(errors)}): a rank of the "
                                  f"new layout must read whole saved files")
        self.zero_checkpoint: Optional[ZeROCheckpoint] = None
        if self.zero_files:
            self.zero_checkpoint = ZeROCheckpoint(self.dir, source_3d=source)
            self.zero_checkpoint.reshape(target)
        self.old_2d_map = meg_2d_parallel_map(source.pp_degree, source.tp_degree)
        self.old_2d_map.simple_init()
        self.new_2d_map = reshape_meg_2d_parallel(source.pp_degree, source.tp_degree, self.pp_degree, self.tp_degree)
        self.original_world_size = source.world_size()
        self.world_size = target.world_size()

    def is_change_tp_degree(self) -> bool:
        return self.tp_degree != self.original_tp_degree

    def is_change_pp_degree(self) -> bool:
        return self.pp_degree != self.original_pp_degree

    def is_change_dp_degree(self) -> bool:
        return self.dp_degree != self.original_dp_degree

    def get_iteration(self) -> int:
        """The saved step (DeepSpeed's ``iteration`` entry where a Megatron script put one, else its
        ``global_steps``)."""
        return int(self.global_state.get("iteration", self.global_state.get("global_steps", 0)))

    def get_args(self) -> Any:
        return self.global_state.get("args")

    def get_checkpoint_info(self, info_key: str = "checkpoint_info") -> Any:
        return self.global_state.get(info_key)

    def get_2d_parallel_files(self, tp_index: int, pp_index: int) -> list[str]:
        """The model files the (pipeline, tensor) rank of the target layout reads."""
        return [self.mp_rank_files[i] for i in self.new_2d_map.get_data(pp_index=pp_index, tp_index=tp_index)]

    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        """The ZeRO files the target rank reads: its own where the layout is the saved one."""
        self._check_indices(pp_index, tp_index, dp_index)
        if self.zero_checkpoint is None:
            return []
        return self.zero_checkpoint.get_files_for_rank(pp_index, tp_index, dp_index)

    def get_zero_checkpoint_state(self, pp_index: int, tp_index: int, dp_index: int,
                                  strip_tensor_paddings: bool = True) -> dict[str, Any]:
        """The target rank's ZeRO state, read as data and merged over its files (see [Note: merging ZeRO
        files for a smaller layout] in checkpoint/deepspeed_format/zero_checkpoint.py)."""
        self._check_indices(pp_index, tp_index, dp_index)
        if self.zero_checkpoint is None:
            raise CheckpointError(f"{self.dir}: no ZeRO files (*_optim_states.pt)")
        return self.zero_checkpoint.get_state_for_rank(pp_index, tp_index, dp_index, keys_to_ignore=["param_shapes"],
                                                       strip_tensor_paddings=strip_tensor_paddings)

    def validate_files(self) -> None:
        for file in self.file_list:
            if not os.path.isfile(file):
                raise CheckpointError(f"{file}: missing from the DeepSpeed checkpoint")

    def _check_indices(self, pp_index: int, tp_index: int, dp_index: int) -> None:
        if pp_index >= self.pp_degree or tp_index >= self.tp_degree or dp_index >= self.dp_degree:
            raise CheckpointError(f"{self.dir}: no rank at pipeline index {pp_index}, tensor index {tp_index}, "
                                  f"data index {dp_index} (degrees {self.pp_degree}, {self.tp_degree}, "
                                  f"{self.dp_degree})")
