"""Reading DeepSpeed's pickled checkpoint files without DeepSpeed and without running their code.

[Note: DeepSpeed's pickles read as data]
DeepSpeed writes its checkpoints with ``torch.save`` and reads them with ``weights_only=False``, which
runs whatever the pickle names.  zeroshard reads them with ``torch.load(weights_only=True)``: tensors,
containers and plain values only, plus the few DeepSpeed classes a checkpoint of ZeRO 0-3 holds, each
allow-listed under DeepSpeed's own name as a small stand-in defined here (a record of the values, no
behaviour): the loss scaler, the stage enum and the tensor-fragment address (and a universal folder's
``SubparamShape``, a plain dataclass of its own, tp_layout.py).  Before anything is
unpickled, the file's globals are listed from its opcodes (``get_unsafe_globals_in_checkpoint``, which
executes nothing); a file that names any other global is refused with every such name listed, so a
crafted file cannot run code, and a file of a newer DeepSpeed that needs another class says which one.
"""

from __future__ import annotations

from enum import IntEnum
from pathlib import Path
from typing import Any

import torch

from ..format import CheckpointError
from .tp_layout import SubparamShape


class DeepSpeedPickleError(CheckpointError):
    """A DeepSpeed checkpoint file that names a global zeroshard does not read as data."""


class ZeroStageEnum(IntEnum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum``."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 4


class _Record:
    """A DeepSpeed object read back as its saved attributes, nothing more."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class fragment_address(_Record):  # noqa: N801 - DeepSpeed's name
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``, ``start``): a
    parameter's piece of a rank's flat partition."""


class LossScaler(_Record):
    """Stand-in for DeepSpeed's static loss scaler: its attributes, as saved."""


class DynamicLossScaler(LossScaler):
    """Stand-in for DeepSpeed's dynamic loss scaler (fp16): its attributes, as saved."""


#: each stand-in under the name DeepSpeed pickles it by
STAND_INS: dict[str, Any] = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
    "deepspeed.utils.tensor_fragment.fragment_address": fragment_address,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScaler,
    "deepspeed.checkpoint.universal_checkpoint.SubparamShape": SubparamShape,
}


def load_deepspeed_file(path: Path) -> Any:
    """The contents of one DeepSpeed checkpoint file, read as data (see [Note: DeepSpeed's pickles read
    as data]); :class:`DeepSpeedPickleError` names every global it would need beyond the stand-ins."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the DeepSpeed checkpoint")
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as err:  # not a torch zip file, or a damaged one
        raise CheckpointError(f"{path}: not a readable torch checkpoint file ({err})") from err
    foreign = sorted(set(needed) - set(STAND_INS))
    if foreign:
        raise DeepSpeedPickleError(
            f"{path}: refused; it needs globals that zeroshard does not read as data: {', '.join(foreign)} "
            f"(nothing was unpickled; zeroshard reads DeepSpeed's files with weights_only=True and stand-ins "
            f"for {', '.join(sorted(STAND_INS))})")
    with torch.serialization.safe_globals([(obj, name) for name, obj in STAND_INS.items()]):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise DeepSpeedPickleError(f"{path}: could not be read as data ({err})") from err
