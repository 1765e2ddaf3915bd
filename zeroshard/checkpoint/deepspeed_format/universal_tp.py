"""A DeepSpeed checkpoint of a tensor-parallel (AutoTP) job as DeepSpeed's universal folder: each
parameter's fragments cut from every rank's flat partitions, then joined (tp_merge.py).

At ZeRO 1-2 the files are DeepSpeed's usual ones, one model file per tensor-parallel rank
(``mp_rank_<tp>_model_states.pt``, its slices' ``param_shapes`` and weights) and one optimizer file per
rank (``zero_pp_rank_<dp>_mp_rank_<tp>_optim_states.pt``) whose ``param_slice_mappings`` say where each
parameter's fragment lies in the rank's flat partition; a parameter that no rank's optimizer holds (never
trained) is written from the model files, whole on every rank.

[Note: AutoTP at ZeRO-3 in DeepSpeed's files]
Under AutoTP at stage 3, DeepSpeed names each rank's files ``zero_pp_rank_<dp>_mp_rank_<tp>_...``: the
``mp_rank`` is the tensor-parallel rank, the ``pp_rank`` the data-parallel one, and each optimizer file
holds that data-parallel rank's partition of its tensor-parallel rank's *slices*.  Each tensor-parallel
rank's model file lists its own slices' shapes (an uneven split gives the ranks different shapes), so a
parameter is rebuilt in two steps: its data-parallel fragments (each ``ceil(numel / dp)`` elements,
the last one short by the padding) joined into each tensor-parallel rank's slice, then the slices joined
by the checkpoint's ``universal_checkpoint_info`` (tp_layout.py).  The universal folder then holds whole
parameters as dicts (``param``, ``cat_dim``, ...), as DeepSpeed's converter writes them for stages 1-2;
the pieces are written to a working folder first, as DeepSpeed's converter does (fragments.py).
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

from ..constants import (BASE_OPTIMIZER_STATE, FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT, PARAM, PARAM_SHAPES,
                         PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS, UNIVERSAL_CHECKPOINT_INFO)
from ..format import CheckpointError
from .ds_checkpoint import DeepSpeedCheckpoint
from .fragments import dump_fragment, group_per_tp_shapes
from .pickler import save_deepspeed_file
from .tp_layout import TpLayoutError, check_conversion_support
from .tp_merge import merge_tp_slices
from .universal import common_optimizer_state
from .universal_read import LATEST_UNIVERSAL, OPTIMIZER_STATE_FILE, ZERO_FOLDER
from .unpickle import load_deepspeed_file

__all__ = ["rank_grid", "write_universal_tp_stage3", "write_universal_tp_stage12"]

_RANKS = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)")


def rank_grid(files: Sequence[str]) -> tuple[list[list[str]], int, int]:
    """``grid[tp][dp]``, the tensor and data-parallel degrees, from stage-3 file names; a missing
    (tp, dp) file is refused (see [Note: AutoTP at ZeRO-3 in DeepSpeed's files])."""
    grid: dict[int, dict[int, str]] = {}
    for path in files:
        match = _RANKS.search(Path(path).name)
        if match is None:
            raise TpLayoutError(f"{path}: not a ZeRO-3 rank file name (zero_pp_rank_<dp>_mp_rank_<tp>)")
        grid.setdefault(int(match.group(2)), {})[int(match.group(1))] = str(path)
    tp_degree = max(grid) + 1
    dp_degree = max(max(ranks) for ranks in grid.values()) + 1
    missing = [(tp, dp) for tp in range(tp_degree) for dp in range(dp_degree) if dp not in grid.get(tp, {})]
    if missing:
        raise TpLayoutError(f"ZeRO-3 checkpoint files missing for (tp rank, dp rank) {missing}")
    return [[grid[tp][dp] for dp in range(dp_degree)] for tp in range(tp_degree)], tp_degree, dp_degree


def _extract(optim_file: str, groups: Sequence[dict[str, Any]], tp: int, dp: int, dp_degree: int,
             work: Path) -> None:
    """Cut rank (``tp``, ``dp``)'s flat partitions into per-parameter fragments, padding dropped."""
    optimizer = load_deepspeed_file(Path(optim_file))[OPTIMIZER_STATE_DICT]
    partition_groups = optimizer.get("ds_zero_partition_groups") or []
    for index, shapes in enumerate(groups):
        state = optimizer[OPTIMIZER_STATE_DICT]["state"][index]
        flats = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"],
                 "fp32": optimizer[FP32_FLAT_GROUPS][index]}
        meta = partition_groups[index] if index < len(partition_groups) else {}
        count, rank = meta.get("partition_count", dp_degree), meta.get("partition_rank", dp)
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            per_rank = math.ceil(numel / count)
            held = max(0, min(per_rank, numel - rank * per_rank))
            for key, flat in flats.items():
                dump_fragment(work, tp, dp, key, flat, name, offset, held)
            offset += per_rank


def _extract_stage12(optimizer: dict[str, Any], tp: int, dp: int, work: Path) -> None:
    """Cut rank (``tp``, ``dp``)'s partitions at ZeRO 1-2 into fragments by its ``param_slice_mappings``."""
    states = optimizer[BASE_OPTIMIZER_STATE]["state"]
    for index, mappings in enumerate(optimizer[PARAM_SLICE_MAPPINGS]):
        flats = {"exp_avg": states[index]["exp_avg"], "exp_avg_sq": states[index]["exp_avg_sq"],
                 "fp32": optimizer[SINGLE_PARTITION_OF_FP32_GROUPS][index]}
        if "step" in states[index]:
            flats["step"] = states[index]["step"]
        for name, where in mappings.items():
            for key, flat in flats.items():
                dump_fragment(work, tp, dp, key, flat, name, where.start, where.numel)


def _join_all(uc_info: dict[str, Any], shapes: dict[str, list[Any]], tp_degree: int, work: Path, zero: Path,
              strict: bool) -> None:
    """Every parameter joined from the working folder; ``strict`` refuses patterns no parameter used."""
    unused: Optional[set[str]] = None
    for name in sorted(shapes):
        left = merge_tp_slices(uc_info, zero, work, tp_degree, (name, shapes[name]))
        unused = set(left) if unused is None else unused & left
    if strict and unused:
        raise TpLayoutError(f"universal_checkpoint_info patterns matched no parameter: {sorted(unused)}")


def _finish(optimizer: dict[str, Any], model_files: Sequence[str], output_folder: Path, work: Path,
            keep_work_folder: bool) -> Path:
    zero = output_folder / ZERO_FOLDER
    zero.mkdir(parents=True, exist_ok=True)
    save_deepspeed_file(optimizer, zero / OPTIMIZER_STATE_FILE)
    if not keep_work_folder:
        shutil.rmtree(work, ignore_errors=True)
    for model_file in model_files:
        shutil.copy2(model_file, output_folder)
    (output_folder.parent / LATEST_UNIVERSAL).write_text(output_folder.name)
    return output_folder


def write_universal_tp_stage12(checkpoint: DeepSpeedCheckpoint, output_folder: Path, strict: bool = True,
                               keep_work_folder: bool = False) -> Path:
    """The universal folder of a ZeRO 1-2 AutoTP checkpoint of one pipeline stage."""
    if checkpoint.pp_degree > 1:
        raise CheckpointError(f"{checkpoint.dir}: a checkpoint of tensor and pipeline parallelism together is not "
                              f"converted")
    uc_info = checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO) or {}
    check_conversion_support(uc_info)
    models = [load_deepspeed_file(Path(f)) for f in checkpoint.mp_rank_files]
    shapes = group_per_tp_shapes([{k: v for group in m[PARAM_SHAPES] for k, v in group.items()} for m in models],
                                 1, checkpoint.tp_degree)
    work, zero = output_folder / "tmp", output_folder / ZERO_FOLDER
    for tp in range(checkpoint.tp_degree):
        for dp in range(checkpoint.dp_degree):
            state = checkpoint.get_zero_checkpoint_state(0, tp, dp)[OPTIMIZER_STATE_DICT]
            _extract_stage12(state, tp, dp, work)
    _join_all(uc_info, shapes, checkpoint.tp_degree, work, zero, strict)
    for model in models:
        for name, tensor in (model.get("module") or {}).items():
            if not (zero / name / "fp32.pt").is_file():
                (zero / name).mkdir(parents=True, exist_ok=True)
                save_deepspeed_file({PARAM: tensor.float()}, zero / name / "fp32.pt")
    rank0 = checkpoint.get_zero_checkpoint_state(0, 0, 0)[OPTIMIZER_STATE_DICT]
    return _finish(common_optimizer_state(rank0, 2), checkpoint.mp_rank_files, output_folder, work,
                   keep_work_folder)


def write_universal_tp_stage3(model_files: Sequence[str], optim_files: Sequence[str], output_folder: Path,
                              strict: bool = True, keep_work_folder: bool = False) -> Path:
    """The universal folder of a ZeRO-3 AutoTP checkpoint (see [Note: AutoTP at ZeRO-3 in DeepSpeed's
    files]).  ``strict`` refuses ``universal_checkpoint_info`` patterns that matched no parameter."""
    model_grid, tp_degree, dp_degree = rank_grid(model_files)
    optim_grid, tp_optim, dp_optim = rank_grid(optim_files)
    if (tp_degree, dp_degree) != (tp_optim, dp_optim):
        raise TpLayoutError(f"model files are of (tp, dp) = {(tp_degree, dp_degree)}, optimizer files of "
                            f"{(tp_optim, dp_optim)}")
    uc_info = load_deepspeed_file(Path(model_grid[0][0])).get(UNIVERSAL_CHECKPOINT_INFO) or {}
    check_conversion_support(uc_info)
    groups_by_tp = [load_deepspeed_file(Path(model_grid[tp][0]))[PARAM_SHAPES] for tp in range(tp_degree)]
    work = output_folder / "tmp"
    for tp in range(tp_degree):
        for dp in range(dp_degree):
            _extract(optim_grid[tp][dp], groups_by_tp[tp], tp, dp, dp_degree, work)
    shapes_by_tp = [{k: v for group in groups for k, v in group.items()} for groups in groups_by_tp]
    names = {name for shapes in shapes_by_tp for name in shapes}
    _join_all(uc_info, {n: [shapes[n] for shapes in shapes_by_tp] for n in names}, tp_degree, work,
              output_folder / ZERO_FOLDER, strict)
    optimizer = load_deepspeed_file(Path(optim_grid[0][0]))[OPTIMIZER_STATE_DICT]
    return _finish(common_optimizer_state(optimizer, 3), model_files, output_folder, work, keep_work_folder)
