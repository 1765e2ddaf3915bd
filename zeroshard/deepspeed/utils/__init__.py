"""``zeroshard.utils`` (DeepSpeed's ``deepspeed.utils``): the logger and ``log_dist`` (its module
``logging``, DeepSpeed's ``deepspeed.utils.logging``), ``RepeatingLoader``, ``set_random_seed``, ``zero_to_fp32``, the tensor-fragment functions (``safe_get_full_fp32_param``, ...)
and the ZeRO-3 leaf-module marks (``set_z3_leaf_modules``, ...).  As in DeepSpeed, the attribute
``z3_leaf_module`` is the function; the module of that name is ``sys.modules``' (``import
deepspeed.utils.z3_leaf_module``)."""

from __future__ import annotations

import random
from typing import Any, Iterable, Iterator

# ``torch`` in this package is its submodule utils/torch.py, as in DeepSpeed
import torch as _torch

from . import groups, logging, tensor_fragment, torch, zero_to_fp32
from .init_on_device import OnDevice
from .logging import log_dist, logger
from .tensor_fragment import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                              safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                              safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state,
                              safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state,
                              safe_update_full_grad_vectorized)
from .z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,
                             set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules,
                             z3_leaf_module, z3_leaf_parameter)

__all__ = ["groups", "logger", "log_dist", "RepeatingLoader", "set_random_seed", "zero_to_fp32", "tensor_fragment",
           "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
           "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_set_full_grad",
           "safe_update_full_grad_vectorized", "safe_get_local_fp32_param", "safe_set_local_fp32_param",
           "safe_get_local_optimizer_state", "safe_set_local_optimizer_state", "safe_get_local_grad",
           "safe_set_local_grad", "z3_leaf_module", "set_z3_leaf_modules", "unset_z3_leaf_modules",
           "get_z3_leaf_modules", "z3_leaf_parameter", "set_z3_leaf_module", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "OnDevice"]


class RepeatingLoader:
    """Iterate a data loader forever, starting it over (a new epoch) each time it runs out."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators on this rank."""
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    _torch.manual_seed(seed)
