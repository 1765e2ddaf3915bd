"""DeepSpeed's ``DeepSpeedCheckpoint``: what one tag's folder of a DeepSpeed checkpoint holds, read as data.

[Note: DeepSpeed's checkpoint description]
DeepSpeed's class describes a checkpoint's files and its tensor x pipeline x data layout, and hands
out each rank's optimizer file; its conversion tools (``ds_to_universal``) are built on it.  zeroshard's
reads the same files with its safe unpickling (unpickle.py): the file lists, the layout the files name
(``checkpoint_parallel_dimensions``, the number of ZeRO files), the iteration, the model file's entries
and each data-parallel rank's optimizer file.  Reshaping a tensor- or pipeline-parallel checkpoint to
another layout (DeepSpeed's Megatron-style maps) is not done: asking for another tensor or pipeline
degree is refused by name; another data-parallel degree is what zeroshard's loader and ``zeroshard
convert --to deepspeed`` do for one data-parallel group.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from ..format import CheckpointError
from .unpickle import load_deepspeed_file

_ZERO_FILE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


class DeepSpeedCheckpoint:
    """One tag's folder of a DeepSpeed checkpoint (see [Note: DeepSpeed's checkpoint description])."""

    def __init__(self, dir: str, tp_degree: Optional[int] = None, pp_degree: Optional[int] = None,  # noqa: A002
                 dp_degree: Optional[int] = None, final_layer_norm_idx: int = -1) -> None:
        self.dir = str(dir)
        folder = Path(dir)
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: not a DeepSpeed checkpoint folder")
        self.final_layer_norm_idx = final_layer_norm_idx
        self.file_list = sorted(str(p) for p in folder.iterdir() if p.is_file())
        names = [Path(f).name for f in self.file_list]
        self.layer_files = [f for f, n in zip(self.file_list, names) if n.startswith("layer_")]
        self.mp_rank_files = [f for f, n in zip(self.file_list, names) if n.startswith("mp_rank_")
                              or re.match(r"^zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$", n)]
        self.zero_files = sorted((f for f, n in zip(self.file_list, names) if _ZERO_FILE.match(n)),
                                 key=lambda f: tuple(int(x) for x in _ZERO_FILE.match(Path(f).name).groups()))  # type: ignore[union-attr]
        if not self.mp_rank_files:
            raise CheckpointError(f"{folder}: no model states file (mp_rank_*_model_states.pt)")
        self.global_state: dict[str, Any] = load_deepspeed_file(Path(self.mp_rank_files[0]))
        dims = self.global_state.get("checkpoint_parallel_dimensions") or {}
        self.original_tp_degree = int(dims.get("tp_degree", self.global_state.get("mp_world_size", 1)) or 1)
        self.original_pp_degree = int(dims.get("pp_degree", 1) or 1)
        ranks = {int(_ZERO_FILE.match(Path(f).name).group(1)) for f in self.zero_files}  # type: ignore[union-attr]
        self.original_dp_degree = len(ranks) or int(self.global_state.get("dp_world_size", 1))
        self.tp_degree = self.original_tp_degree if tp_degree is None else tp_degree
        self.pp_degree = self.original_pp_degree if pp_degree is None else pp_degree
        self.dp_degree = self.original_dp_degree if dp_degree is None else dp_degree
        if self.is_change_tp_degree() or self.is_change_pp_degree():
            raise CheckpointError(f"{folder}: reshaping a DeepSpeed checkpoint to tensor degree {self.tp_degree} / "
                                  f"pipeline degree {self.pp_degree} (saved at {self.original_tp_degree} / "
                                  f"{self.original_pp_degree}) is not done; zeroshard reshards one data-parallel group")
        self.original_world_size = self.original_tp_degree * self.original_pp_degree * self.original_dp_degree
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree

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

    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        """The optimizer file of data-parallel rank ``dp_index`` (of tensor rank ``tp_index``)."""
        self._check_indices(pp_index, tp_index)
        return [f for f in self.zero_files if _ZERO_FILE.match(Path(f).name).groups()  # type: ignore[union-attr]
                == (str(dp_index), f"{tp_index:02d}")]

    def get_zero_checkpoint_state(self, pp_index: int, tp_index: int, dp_index: int,
                                  strip_tensor_paddings: bool = True) -> dict[str, Any]:
        """Rank ``dp_index``'s optimizer file, read as data (its partitions as saved)."""
        files = self.get_zero_files(pp_index, tp_index, dp_index)
        if not files:
            raise CheckpointError(f"{self.dir}: no optimizer file of data-parallel rank {dp_index}")
        state: dict[str, Any] = load_deepspeed_file(Path(files[0]))
        return state

    def validate_files(self) -> None:
        for file in self.file_list:
            if not Path(file).is_file():
                raise CheckpointError(f"{file}: missing from the DeepSpeed checkpoint")

    def _check_indices(self, pp_index: int, tp_index: int) -> None:
        if pp_index >= self.pp_degree or tp_index >= self.tp_degree:
            raise CheckpointError(f"{self.dir}: no rank at pipeline index {pp_index}, tensor index {tp_index} "
                                  f"(degrees {self.pp_degree}, {self.tp_degree})")
