"""What a DeepSpeed checkpoint's model files say about its layout: the pipeline x tensor degrees each
records (``checkpoint_parallel_dimensions``, written by :func:`checkpoint_parallel_metadata`), the
pipeline x tensor x data descriptor read from them (:func:`get_model_3d_descriptor`), and the entries
DeepSpeed's universal conversion needs of every model file, checked to agree
(:func:`aggregate_autoep_zero12_metadata`).

[Note: a checkpoint's layout from its files]
Each model file records its pipeline and tensor degrees; the data degree is the number of ZeRO files
over the number of model files.  Where the files record degrees, every model file must record the
same ones, and the counts of model and ZeRO files must fit them; a file without the entry among files
with it, or files that disagree, is an error naming the files, never a guess.  Files written before
the entry existed are read by their names: with pipeline layer files, the tensor degree is the number
of files of the first transformer layer (``layer_01-model_*``); without, every model file is a tensor
rank of one stage.  The model files are read once: a descriptor keeps only these small entries of each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ..constants import (AUTOEP_EXPERT_KEY_PREFIX, AUTOEP_LAYERS_KEY, AUTOEP_LAYERS_KEY_LEGACY,
                         AUTOEP_ZERO12_REQUIRED_FIELDS, CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE,
                         CHECKPOINT_TP_DEGREE, LAYER_FILE_PREFIX, PARAM_SHAPES)
from ..format import CheckpointError
from .reshape_maps import model_3d_desc
from .unpickle import load_deepspeed_file

__all__ = ["checkpoint_parallel_metadata", "model_file_metadata", "descriptor_from_metadata",
           "get_model_3d_descriptor", "aggregate_autoep_zero12_metadata", "list_checkpoint_files", "CheckpointFiles",
           "DS_CONFIG_KEY"]

DS_CONFIG_KEY = "ds_config"
DATA_BEFORE_EXPERTS = "use_data_before_expert_parallelism"
#: the entries of an AutoEP layer's record the conversion reads
AUTOEP_FIELDS = ("moe_layer_id", "module_path", *AUTOEP_ZERO12_REQUIRED_FIELDS)
#: one model file's name and the small entries kept of it
FileMetadata = tuple[str, dict[str, Any]]


_ZERO_FILE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_FILE = re.compile(r"^mp_rank_\d+_model_states\.pt$")
_STAGE3_MODEL_FILE = re.compile(r"^zero_pp_rank_0_mp_rank_\d+_model_states\.pt$")


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one tag's folder, by role, each list in DeepSpeed's order."""

    all_files: list[str]
    #: one per pipeline x tensor rank, pipeline-major (at stage 3, data rank 0's)
    model_files: list[str]
    #: one per data x pipeline x tensor rank, data-major
    zero_files: list[str]
    #: pipeline layer files (``layer_XX-model_YY_model_states.pt``)
    layer_files: list[str]


def list_checkpoint_files(directory: str) -> CheckpointFiles:
    """The files of the DeepSpeed checkpoint folder ``directory`` (not its subfolders), by role."""
    folder = Path(directory)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a DeepSpeed checkpoint folder")
    files = sorted(str(p) for p in folder.iterdir() if p.is_file())
    named = [(f, Path(f).name) for f in files]
    zero = sorted((f for f, n in named if _ZERO_FILE.match(n)),
                  key=lambda f: tuple(int(x) for x in _ZERO_FILE.match(Path(f).name).groups()))  # type: ignore[union-attr]
    model = [f for f, n in named if _MODEL_FILE.match(n)] or [f for f, n in named if _STAGE3_MODEL_FILE.match(n)]
    layers = [f for f, n in named if n.startswith(LAYER_FILE_PREFIX)]
    return CheckpointFiles(files, model, zero, layers)


def _world_size(mpu: Any, getters: Sequence[str]) -> int:
    for getter in getters:
        if hasattr(mpu, getter):
            return int(getattr(mpu, getter)())
    return 1


def checkpoint_parallel_metadata(mpu: Any) -> dict[str, dict[str, int]]:
    """The ``checkpoint_parallel_dimensions`` entry of a model file saved under ``mpu`` (Megatron's or
    DeepSpeed's topology object; None for data parallelism alone)."""
    if mpu is None:
        pp, tp = 1, 1
    else:
        pp = _world_size(mpu, ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size"))
        tp = _world_size(mpu, ("get_tensor_model_parallel_world_size", "get_slice_parallel_world_size",
                               "get_model_parallel_world_size"))
    return {CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: pp, CHECKPOINT_TP_DEGREE: tp}}


def _kind(value: Any) -> Any:
    """A malformed entry kept as its type's name, so a check can say what it found."""
    return type(value).__name__


def model_file_metadata(state: dict[str, Any]) -> dict[str, Any]:
    """The entries of one model file a descriptor and the universal conversion read."""
    dims = state.get(CHECKPOINT_PARALLEL_DIMS)
    if isinstance(dims, dict):
        dims = {key: dims.get(key) for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE)}
    elif dims is not None:
        dims = _kind(dims)
    shapes = state.get(PARAM_SHAPES)
    if isinstance(shapes, (list, tuple)) and all(isinstance(group, dict) for group in shapes):
        shapes = {name: shape for group in shapes for name, shape in group.items()}
    elif shapes is not None:
        shapes = _kind(shapes)
    layers = state.get(AUTOEP_LAYERS_KEY, state.get(AUTOEP_LAYERS_KEY_LEGACY))
    if isinstance(layers, list):
        layers = [{k: entry[k] for k in AUTOEP_FIELDS if k in entry} if isinstance(entry, dict) else _kind(entry)
                  for entry in layers]
    elif layers is not None:
        layers = _kind(layers)
    config = state.get(DS_CONFIG_KEY, {})
    if isinstance(config, dict):
        order = config.get(DATA_BEFORE_EXPERTS, False)
        config = {DATA_BEFORE_EXPERTS: order if isinstance(order, bool) else _kind(order)}
    else:
        config = _kind(config)
    return {CHECKPOINT_PARALLEL_DIMS: dims, PARAM_SHAPES: shapes, AUTOEP_LAYERS_KEY: layers, DS_CONFIG_KEY: config}


def _recorded_degrees(file: str, dims: Any) -> tuple[int, int]:
    if not isinstance(dims, dict):
        raise CheckpointError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} must be a dictionary in {file}.")
    degrees = []
    for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE):
        value = dims.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"Checkpoint {key} must be a positive integer in {file}, got {value!r}.")
        degrees.append(value)
    return degrees[0], degrees[1]


def descriptor_from_metadata(file_list: Sequence[str], zero_files: Sequence[str],
                             metadata: Sequence[FileMetadata]) -> model_3d_desc:
    """The layout of a checkpoint (see [Note: a checkpoint's layout from its files])."""
    if not metadata:
        raise CheckpointError("a DeepSpeed checkpoint without model files (mp_rank_*_model_states.pt) has no layout")
    recorded = {file: m.get(CHECKPOINT_PARALLEL_DIMS) for file, m in metadata}
    missing = [file for file, dims in recorded.items() if dims is None]
    if len(missing) == len(recorded):
        first_layer = [f for f in file_list if Path(f).name.startswith(f"{LAYER_FILE_PREFIX}01")]
        tp = len(first_layer) or len(metadata)
        pp = max(1, len(metadata) // tp)
        return model_3d_desc(pp, tp, max(1, len(zero_files) // (pp * tp)))
    if missing:
        raise CheckpointError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: {missing}")
    degrees = {file: _recorded_degrees(file, dims) for file, dims in recorded.items()}
    if len(set(degrees.values())) != 1:
        raise CheckpointError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: "
                              f"{list(degrees.values())}")
    pp, tp = next(iter(degrees.values()))
    if len(metadata) != pp * tp:
        raise CheckpointError(f"Checkpoint model-state file count {len(metadata)} does not match "
                              f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")
    if len(zero_files) % (pp * tp):
        raise CheckpointError(f"Checkpoint ZeRO file count {len(zero_files)} is not divisible by "
                              f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")
    return model_3d_desc(pp, tp, max(1, len(zero_files) // (pp * tp)))


def read_model_files(model_files: Sequence[str]) -> tuple[list[FileMetadata], dict[str, Any]]:
    """Each model file read once (as data): the small entries of every one, and the first file whole."""
    metadata: list[FileMetadata] = []
    first: dict[str, Any] = {}
    for index, file in enumerate(model_files):
        state = load_deepspeed_file(Path(file))
        if not isinstance(state, dict):
            raise CheckpointError(f"{file}: a model file holds a dictionary, not {type(state).__name__}")
        metadata.append((file, model_file_metadata(state)))
        if index == 0:
            first = state
    return metadata, first


def get_model_3d_descriptor(dir: str) -> model_3d_desc:  # noqa: A002 - DeepSpeed's name
    """The pipeline x tensor x data layout of the DeepSpeed checkpoint in folder ``dir``."""
    files = list_checkpoint_files(dir)
    metadata, _ = read_model_files(files.model_files)
    return descriptor_from_metadata(files.all_files, files.zero_files, metadata)


def aggregate_autoep_zero12_metadata(
        metadata: Sequence[FileMetadata]) -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]], bool]:
    """What a stage 1-2 universal conversion needs of every model file, checked to agree: each file's
    parameter shapes (one dict per file, in file order), the AutoEP layers' records (one per expert
    prefix; None without AutoEP) and whether data ranks come before expert ranks."""
    shapes_per_file: list[dict[str, Any]] = []
    layers: dict[str, dict[str, Any]] = {}
    layer_source: dict[str, str] = {}
    orders: dict[str, bool] = {}
    for file, entries in metadata:
        shapes = entries.get(PARAM_SHAPES)
        if not isinstance(shapes, dict):
            raise CheckpointError(f"DeepSpeed checkpoint {PARAM_SHAPES} must contain dictionaries in {file}.")
        shapes_per_file.append(shapes)
        records = entries.get(AUTOEP_LAYERS_KEY)
        if records is not None and not isinstance(records, list):
            raise CheckpointError(f"AutoEP metadata must be a list in {file}.")
        for record in records or []:
            if not isinstance(record, dict):
                raise CheckpointError(f"AutoEP layer metadata must contain dictionaries in {file}.")
            prefix = record.get(AUTOEP_EXPERT_KEY_PREFIX)
            if not isinstance(prefix, str) or not prefix:
                raise CheckpointError(f"AutoEP {AUTOEP_EXPERT_KEY_PREFIX} must be a non-empty string in {file}.")
            if prefix in layers and layers[prefix] != record:
                raise CheckpointError(f"Conflicting AutoEP metadata for {AUTOEP_EXPERT_KEY_PREFIX} {prefix!r} in "
                                      f"{layer_source[prefix]} and {file}.")
            layers.setdefault(prefix, record)
            layer_source.setdefault(prefix, file)
        config = entries.get(DS_CONFIG_KEY)
        if not isinstance(config, dict):
            raise CheckpointError(f"DeepSpeed checkpoint {DS_CONFIG_KEY} must be a dictionary in {file}.")
        order = config.get(DATA_BEFORE_EXPERTS, False)
        if not isinstance(order, bool):
            raise CheckpointError(f"DeepSpeed checkpoint {DATA_BEFORE_EXPERTS} must be a boolean in {file}.")
        orders[file] = order
    if len(set(orders.values())) > 1:
        raise CheckpointError(f"DeepSpeed checkpoint {DATA_BEFORE_EXPERTS} disagrees across model-state files: "
                              f"{orders}")
    return shapes_per_file, list(layers.values()) or None, next(iter(orders.values()), False)
