"""DeepSpeed's ``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save``, which Accelerate calls on a
state dict before ``torch.save``, so that views do not drag their whole storage into the file; the names
DeepSpeed's own format gives a rank's files (``get_model_ckpt_name_for_rank``, ``get_zero_ckpt_name_for_rank``,
``get_layer_ckpt_name_for_rank``: tools that read DeepSpeed checkpoints build them; zeroshard's format is in
format.py); and ``make_executable``, for a script kept beside checkpoints."""

from __future__ import annotations

import os
import re
import stat
from typing import Any

from ..logging import logger

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """Copies of every tensor in a (nested) state dict, on ``device``."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, dict):
        return {k: clone_tensors_for_torch_save(v, device) for k, v in item.items()}
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item


def get_model_ckpt_name_for_rank(base_folder: str | os.PathLike[str], mp_rank_str: str) -> str:
    """``<base_folder>/mp_rank_<mp_rank_str>_model_states.pt`` (``mp_rank_str``: the rank as DeepSpeed
    writes it, two digits, e.g. ``"00"``)."""
    return os.path.join(os.fspath(base_folder), f"mp_rank_{mp_rank_str}_model_states.pt")


def make_executable(path: str | os.PathLike[str]) -> bool:
    """Add the owner's execute bit to ``path``; False, with an info line, where the file is missing or
    the file system refuses permission changes (Azure file shares and other mounted stores do): a
    script's mode is a convenience, never worth failing a save for."""
    try:
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
        return True
    except (FileNotFoundError, PermissionError) as err:
        logger.info(f"could not make {os.fspath(path)} executable ({err}); continuing without changing its mode")
        return False


def get_zero_ckpt_name_for_rank(base_folder: str | os.PathLike[str], dp_rank: int, mp_rank: int) -> str:
    """``<base_folder>/zero_pp_rank_<dp_rank>_mp_rank_<mp_rank, two digits>_optim_states.pt``: a ZeRO
    rank's optimizer file in DeepSpeed's format."""
    return os.path.join(os.fspath(base_folder), f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")


def get_layer_ckpt_name_for_rank(base_folder: str | os.PathLike[str], layer_id: str, tp_rank: int) -> str:
    """``<base_folder>/<layer_id>-model_<tp_rank, two digits>_model_states.pt``: a pipeline layer's file of
    a tensor-parallel rank in DeepSpeed's format (``layer_id`` as DeepSpeed names it, e.g. ``layer_01``)."""
    return os.path.join(os.fspath(base_folder), f"{layer_id}-model_{tp_rank:02d}_model_states.pt")


def rank_order(name: str) -> list[Any]:
    """A sort key for a checkpoint's file names: digits compared as numbers, so rank 10's file sorts after
    rank 2's (a plain sort puts it between 1 and 2, and the ranks' shards would be joined out of order)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
