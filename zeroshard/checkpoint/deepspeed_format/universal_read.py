"""Reading DeepSpeed's universal checkpoint folders (see [Note: DeepSpeed's universal layout] in
checkpoint/deepspeed_format/universal.py).

[Note: a universal folder of a tensor-parallel job]
A universal folder converted from a tensor-parallel checkpoint (universal_tp.py) keeps every rank's
model file, whose ``param_shapes`` are that rank's slices, while its parameter files hold the joined
parameters in their whole shape.  Such a folder (a model file of tensor rank 1 beside rank 0's) is read
with each parameter's shape taken from its ``fp32.pt``: the parameters and moments are whole, as an
engine without tensor parallelism loads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..format import CheckpointError
from .partitions import MOMENTS, WholeState
from .unpickle import load_deepspeed_file

#: the folder of per-parameter files inside a universal checkpoint
ZERO_FOLDER = "zero"
#: the file beside the output folder naming it (DeepSpeed's ``latest`` for universal checkpoints)
LATEST_UNIVERSAL = "latest_universal"
OPTIMIZER_STATE_FILE = "optimizer_state.pt"
#: the per-parameter files and the state each holds
STATE_FILES = {"param": "fp32", **{m: m for m in MOMENTS}}


def is_universal(directory: Path) -> bool:
    return (directory / ZERO_FOLDER / OPTIMIZER_STATE_FILE).is_file()


def _is_tensor_parallel(directory: Path) -> bool:
    return any(directory.glob("*mp_rank_01_model_states.pt"))


def _whole_shapes(zero: Path, groups: list[dict[str, torch.Size]]) -> list[dict[str, torch.Size]]:
    """Each parameter's whole shape from its joined ``fp32.pt`` (see [Note: a universal folder of a
    tensor-parallel job])."""
    out = []
    for shapes in groups:
        whole = {}
        for name in shapes:
            value = load_deepspeed_file(zero / name / "fp32.pt")
            tensor = value.get("param") if isinstance(value, dict) else None
            if not isinstance(tensor, torch.Tensor):
                raise CheckpointError(f"{zero / name / 'fp32.pt'}: holds no joined tensor-parallel parameter")
            whole[name] = tensor.shape
        out.append(whole)
    return out


def _tensor(value: Any, path: Path) -> torch.Tensor:
    tensor = value.get("param") if isinstance(value, dict) else value
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"{path}: holds no tensor")
    return tensor.reshape(-1).float()


def read_universal(directory: Path, groups: list[dict[str, torch.Size]]) -> tuple[WholeState, dict[str, Any]]:
    """Every trained parameter (``groups``: the model file's ``param_shapes``) whole from a universal
    folder, and its ``optimizer_state.pt`` (see [Note: DeepSpeed's universal layout] in
    checkpoint/deepspeed_format/universal.py)."""
    zero = directory / ZERO_FOLDER
    optimizer: dict[str, Any] = load_deepspeed_file(zero / OPTIMIZER_STATE_FILE)
    if _is_tensor_parallel(directory):
        groups = _whole_shapes(zero, groups)
    whole = WholeState({k: v for g in groups for k, v in g.items()})
    torch_state = (optimizer.get("optimizer_state_dict") or {}).get("state") or {}
    for g, shapes in enumerate(groups):
        for name, shape in shapes.items():
            entry = {}
            for key, file in STATE_FILES.items():
                path = zero / name / f"{file}.pt"
                entry[key] = _tensor(load_deepspeed_file(path), path)
                if entry[key].numel() != torch.Size(shape).numel():
                    raise CheckpointError(f"{path}: {entry[key].numel()} elements, but {name} has shape {tuple(shape)}")
            whole.tensors[name] = entry
            whole.group_of[name] = g
        if len(whole.scalars) == g:
            first = next(iter(shapes), None)
            step_file = zero / str(first) / "step.pt"
            if step_file.is_file():
                step = load_deepspeed_file(step_file)
            else:
                step = (torch_state.get(g) or {}).get("step")
            whole.scalars.append({} if step is None else {"step": torch.as_tensor(step, dtype=torch.float32).clone()})
    return whole, optimizer
