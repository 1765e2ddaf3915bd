"""``deepspeed.utils.torch``: ``required_torch_version``, the torch-version test DeepSpeed code asks."""

from __future__ import annotations

from typing import Union

import torch
from torch.torch_version import TorchVersion

__all__ = ["required_torch_version"]

Version = Union[str, float, int, None]


def required_torch_version(min_version: Version = None, max_version: Version = None) -> bool:
    """Whether the running torch is at least ``min_version`` and at most ``max_version`` (either may be
    left out, not both); versions compare as releases do (``"2.4"`` < ``"2.13.0"``; a build's local
    suffix, ``+cpu``, counts above the bare release)."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version() needs a min_version or a max_version")
    running = TorchVersion(torch.__version__)
    if min_version is not None and running < str(min_version):
        return False
    return max_version is None or running <= str(max_version)
