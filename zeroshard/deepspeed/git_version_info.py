"""``deepspeed.git_version_info``: what DeepSpeed records about its build, answered for zeroshard.

``version`` is the DeepSpeed version zeroshard answers with (``deepspeed.__version__`` under
``install_as_deepspeed()``); zeroshard is installed from no DeepSpeed checkout, so ``git_hash`` and
``git_branch`` are ``"[none]"``; ``installed_ops`` lists every op as not built (zeroshard builds none:
see ops/op_builder.py); ``torch_info`` is the running torch's, where DeepSpeed records the torch it was
built against.  ``accelerator_name`` and ``torch_info`` are computed when first read, not when zeroshard
is imported: asking torch about CUDA in a process that later forks its ranks would spoil CUDA for them.
"""

from __future__ import annotations

import torch

from .accelerator import get_accelerator
from .install import DEEPSPEED_VERSION
from .ops.op_builder import ALL_OPS

__all__ = ["version", "git_hash", "git_branch", "installed_ops", "accelerator_name", "torch_info"]

version = DEEPSPEED_VERSION
git_hash = "[none]"
git_branch = "[none]"
installed_ops = dict.fromkeys(ALL_OPS, False)


def _major_minor(value: object) -> str:
    """``"2.13"`` from ``"2.13.0+cpu"`` or ``(2, 21, 5)``; ``"0.0"`` (DeepSpeed's "none") from None."""
    if value is None:
        return "0.0"
    parts = value if isinstance(value, tuple) else str(value).split("+")[0].split(".")
    return ".".join(str(p) for p in list(parts)[:2])


def _nccl_version() -> object:
    try:
        return torch.cuda.nccl.version() if torch.version.cuda else None
    except (AttributeError, RuntimeError):
        return None


def __getattr__(name: str) -> object:
    """``accelerator_name`` and ``torch_info``, on first use (see the module's docstring)."""
    if name == "accelerator_name":
        value: object = get_accelerator().device_name()
    elif name == "torch_info":
        value = {"version": _major_minor(torch.__version__), "cuda_version": _major_minor(torch.version.cuda),
                 "nccl_version": _major_minor(_nccl_version()), "hip_version": _major_minor(torch.version.hip)}
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
