"""The model's side of a checkpoint: which state-dict key is which trainable parameter, and the rest.

Trainable parameters are saved as chunks (``optim/sharded_state.py``); what is not trainable (frozen
parameters, buffers) is saved whole, by state-dict name.  Tied weights appear under every name they
have, mapped to the one trainable parameter.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from .sharding.storage import HOMES


class ModuleState:
    """The model's state-dict keys, their trainable parameters, and the non-trainable tensors."""

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter], names: Sequence[str]) -> None:
        self.module = module
        self.params = params
        self.names = names

    def describe(self) -> dict[str, Any]:
        """State-dict keys in order, which trainable parameter each key is (tied weights), the class,
        and a Hugging Face config as a dict when the model has one."""
        index_of = {id(p): i for i, p in enumerate(self.params)}
        keys, trainable_of = [], {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            keys.append(name)
            i = index_of.get(id(tensor))
            if i is not None:
                trainable_of[name] = self.names[i]
            elif (home := HOMES.home_of(tensor)) is not None:  # a released stage-3 parameter's placeholder
                trainable_of[name] = home.name
        config = getattr(self.module, "config", None)
        hf_config = config.to_dict() if config is not None and hasattr(config, "to_dict") else None
        return {"state_dict_keys": keys, "trainable_of": trainable_of, "hf_config": hf_config or None,
                "class": type(self.module).__name__}

    def extra_tensors(self, trainable_keys: set[str]) -> dict[str, torch.Tensor]:
        """Copies of everything in the state dict that is not a trainable parameter."""
        return {name: t.detach().to("cpu", copy=True).contiguous()
                for name, t in self.module.state_dict(keep_vars=True).items() if name not in trainable_keys}

    def load_extra(self, values: dict[str, torch.Tensor]) -> None:
        current = self.module.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in values.items():
                if name in current:
                    current[name].data.copy_(value)
