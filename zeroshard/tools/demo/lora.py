"""LoRA adapters for the demo model (``zeroshard demo --lora``): a frozen base, small trainable updates.

The library trains any model whose frozen parameters are frozen the usual way (``requires_grad``);
peft's ``get_peft_model`` is what Hugging Face users reach for (tests/distributed/test_peft.py).  This
module is the few lines the demo needs without it.
"""

from __future__ import annotations

import math
from typing import Iterable, TypeVar

import torch
from torch import nn


ModelT = TypeVar("ModelT", bound=nn.Module)


class LoRALinear(nn.Module):
    """``base(x) + scale * x A^T B^T``: ``base`` frozen, ``A`` (rank x in) and ``B`` (out x rank) trained.
    ``B`` starts at zero, so the adapted model starts as the base model (as in the LoRA paper)."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def add_lora(model: ModelT, targets: Iterable[str] = ("qkv", "proj", "fc", "out"), rank: int = 8) -> ModelT:
    """Freeze every parameter of ``model`` and wrap its Linear layers named in ``targets`` with adapters."""
    model.requires_grad_(False)
    wanted = set(targets)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in wanted and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank))
    return model
