"""``clone_tensors_for_torch_save`` (DeepSpeed's ``deepspeed.checkpoint.utils``): Accelerate calls it on a
state dict before ``torch.save``, so that views do not drag their whole storage into the file."""

from __future__ import annotations

from typing import Any

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
