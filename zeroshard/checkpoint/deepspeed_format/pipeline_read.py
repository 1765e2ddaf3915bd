"""A checkpoint that DeepSpeed's pipeline engine wrote, read as one model under its layers' global names.

[Note: DeepSpeed's pipeline checkpoint]
A DeepSpeed ``PipelineModule`` registers each layer under its global index (``str(idx)``), so its
parameters are named ``<idx>.<rest>`` in every file: the names zeroshard's pipeline checkpoints use
([Note: a pipeline checkpoint loads at any split] in pipeline/checkpoint.py).  Each stage ``s`` writes
``mp_rank_<s>_model_states.pt`` (no module; ``param_shapes`` of its own trained parameters, already
under global names), one ZeRO optimizer file per data-parallel rank,
``zero_pp_rank_<r>_mp_rank_<s>_optim_states.pt``, laid out as without a pipeline, and one
``layer_<idx>-model_states.pt`` per layer holding the layer's own state dict (its trained and frozen
parameters, its buffers).  Each stage is merged on its own (partitions.py) and the stages' parameter
groups are numbered one after another, so every name keeps the Adam step of the group it was stepped
in.  The layer files give the model's keys and the values the optimizer does not hold.  Read: one
tensor index (``tp_degree`` 1) at ZeRO 1-2 (DeepSpeed's pipeline refuses stage 3); a stage-0 pipeline
(the optimizer inside each stage's model file) and layer files of a tensor-parallel stage are refused.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ..format import CheckpointError
from .partitions import WholeState, merge_stage12
from .unpickle import load_deepspeed_file

_LAYER_FILE = re.compile(r"^layer_(\d+)-model_states\.pt$")


def pipeline_degree(model: dict[str, Any]) -> int:
    """The number of pipeline stages a model file's job had (1: none)."""
    return int((model.get("checkpoint_parallel_dimensions") or {}).get("pp_degree", 1))


def stage_model_file(stage: int) -> str:
    return f"mp_rank_{stage:02d}_model_states.pt"


def stage_optimizer_file(rank: int, stage: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_{stage:02d}_optim_states.pt"


def read_pipeline(directory: Path, stages: int) -> tuple[WholeState, dict[str, Any], bool, list[str]]:
    """Every stage's trained parameters merged into one state (see [Note: DeepSpeed's pipeline
    checkpoint]), rank 0's optimizer state of stage 0 (its hyperparameters), whether it is bf16 and every
    stage's buffer names."""
    bf16 = (directory / stage_optimizer_file(0, 0, True)).is_file()
    if not bf16 and not (directory / stage_optimizer_file(0, 0, False)).is_file():
        raise CheckpointError(f"{directory}: a DeepSpeed pipeline checkpoint without ZeRO optimizer files "
                              f"(ZeRO stage 0, or saved without an optimizer): not read yet")
    whole = WholeState({})
    rank0: dict[str, Any] = {}
    buffers: list[str] = []
    for stage in range(stages):
        path = directory / stage_model_file(stage)
        if not path.is_file():
            raise CheckpointError(f"{directory}: pipeline stage {stage} of {stages} has no {path.name}")
        model = load_deepspeed_file(path)
        buffers.extend(model.get("buffer_names") or [])
        ranks = [load_deepspeed_file(directory / stage_optimizer_file(r, stage, bf16))["optimizer_state_dict"]
                 for r in range(int(model["dp_world_size"]))]
        if int(ranks[0]["zero_stage"]) not in (1, 2):
            raise CheckpointError(f"{path}: a pipeline stage at ZeRO stage {int(ranks[0]['zero_stage'])}: not read")
        part = merge_stage12([dict(g) for g in model["param_shapes"]], ranks, str(path))
        base = len(whole.scalars)
        whole.shapes.update(part.shapes)
        whole.tensors.update(part.tensors)
        whole.group_of.update({name: base + g for name, g in part.group_of.items()})
        whole.scalars.extend(part.scalars)
        if stage == 0:
            rank0 = ranks[0]
    return whole, rank0, bf16, buffers


def layer_states(directory: Path) -> dict[str, torch.Tensor]:
    """Every layer file's state dict, under the layers' global names, in layer order."""
    named = [(p, _LAYER_FILE.match(p.name)) for p in directory.glob("layer_*")]
    if any(m is None for _, m in named):
        raise CheckpointError(f"{directory}: DeepSpeed layer files of a tensor-parallel pipeline "
                              f"(layer_XX-model_YY-model_states.pt) are not read yet")
    out: dict[str, torch.Tensor] = {}
    for index, path in sorted((int(m.group(1)), p) for p, m in named if m is not None):
        out.update({f"{index}.{key}": value for key, value in load_deepspeed_file(path).items()})
    return out
