"""Writing DeepSpeed's pickled checkpoint files without DeepSpeed.

[Note: DeepSpeed's classes written by name]
DeepSpeed's files hold a few objects of its own classes (the loss scaler, the stage enum, the
tensor-fragment address), which its loader unpickles by name and then uses (it steps with the loss
scaler it reads).  zeroshard writes the stand-ins it reads them as (unpickle.py) under DeepSpeed's
names, so that the file names exactly the globals DeepSpeed's own would: ``torch.save`` is given a
pickler that writes a stand-in class as a reference to DeepSpeed's class, without importing
DeepSpeed (which is not installed, or is zeroshard's own face).  The objects are plain records of
values, pickled as DeepSpeed's instances are (the class, then the attributes), so DeepSpeed builds its
own objects from them; every other object is pickled by torch's rules.
"""

from __future__ import annotations

import pickle
import types
from pathlib import Path
from typing import Any

import torch

from .unpickle import STAND_INS

_NAME_OF = {cls: name for name, cls in STAND_INS.items()}


#: the Python pickler (not the C one): its ``save_global`` can be replaced
_PythonPickler: Any = getattr(pickle, "_Pickler")


class _DeepSpeedPickler(_PythonPickler):  # type: ignore[misc]
    def save_global(self, obj: Any, name: Any = None) -> None:
        target = _NAME_OF.get(obj)
        if target is None:
            super().save_global(obj, name)
            return
        module, _, qualname = target.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode("ascii"))
        self.memoize(obj)


_PICKLE_MODULE = types.ModuleType("zeroshard_deepspeed_pickle")
_PICKLE_MODULE.Pickler = _DeepSpeedPickler  # type: ignore[attr-defined]


def save_deepspeed_file(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` with the stand-ins written as DeepSpeed's classes (see [Note:
    DeepSpeed's classes written by name])."""
    torch.save(obj, path, pickle_module=_PICKLE_MODULE)  # type: ignore[arg-type]


def stand_in(name: str, **values: Any) -> Any:
    """An object of the stand-in for DeepSpeed's class ``name`` holding ``values``."""
    obj = STAND_INS[name].__new__(STAND_INS[name])
    obj.__dict__.update(values)
    return obj
