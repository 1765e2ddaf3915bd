"""The model's side of a checkpoint: which state-dict key is which trainable parameter, and the rest.

Trainable parameters are saved as chunks (``optim/sharded_state.py``); what is not trainable (frozen
parameters, buffers) is saved whole, by state-dict name.  Tied weights appear under every name they
have, mapped to the one trainable parameter; a frozen weight under several names is saved under each,
and ``frozen_tied_to`` maps each further name to its first.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..sharding.layout import BucketLayout
from ..sharding.storage import HOMES, ParameterStorage


def _jsonable(value: Any) -> Any:
    """A peft config's values as JSON has them (sets become sorted lists, enums their values)."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    return value


def _peft_config(module: nn.Module) -> Optional[dict[str, Any]]:
    """A peft model's adapter configs, by adapter name (what ``zeroshard consolidate --trainable-only``
    writes as ``adapter_config.json``); None for other models."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict):
        return None
    return {name: _jsonable(cfg.to_dict()) for name, cfg in configs.items() if hasattr(cfg, "to_dict")} or None


class ModuleState:
    """The model's state-dict keys, their trainable parameters, and the non-trainable tensors.

    ``storage`` holds, at stage 3, frozen parameters too (sharded; see [Note: frozen parameters at
    stage 3] in sharding/stage3/units.py): they are saved whole like every non-trainable tensor, gathered one
    bucket at a time, and loaded back into their shards.
    """

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter], names: Sequence[str],
                 storage: Optional[ParameterStorage] = None) -> None:
        self.module = module
        self.params = params
        self.names = names
        self.storage = storage
        self._trainable_names = set(names)

    def _frozen_buckets(self) -> list[BucketLayout]:
        return [b for b in self.storage.layout.buckets if b.frozen] if self.storage is not None else []

    def _sharded_frozen_name(self, tensor: torch.Tensor) -> Optional[str]:
        """The parameter name of a frozen parameter (or its placeholder) that the storage holds."""
        home = HOMES.home_of(tensor)
        return home.name if home is not None and home.name not in self._trainable_names else None

    def describe(self) -> dict[str, Any]:
        """State-dict keys in order, which trainable parameter each key is (tied weights), the class,
        and a Hugging Face config as a dict when the model has one."""
        index_of = {id(p): i for i, p in enumerate(self.params)}
        keys, trainable_of = [], {}
        frozen_first: dict[Any, str] = {}  # a frozen parameter (its stage-3 name, or the tensor) -> its first key
        frozen_tied_to: dict[str, str] = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            keys.append(name)
            i = index_of.get(id(tensor))
            if i is not None:
                trainable_of[name] = self.names[i]
            elif (home := HOMES.home_of(tensor)) is not None and home.name in self._trainable_names:
                trainable_of[name] = home.name  # a released stage-3 parameter's placeholder
            elif isinstance(tensor, nn.Parameter) or self._sharded_frozen_name(tensor) is not None:
                frozen = self._sharded_frozen_name(tensor) or id(tensor)
                if frozen in frozen_first:
                    frozen_tied_to[name] = frozen_first[frozen]
                else:
                    frozen_first[frozen] = name
        config = getattr(self.module, "config", None)
        hf_config = config.to_dict() if config is not None and hasattr(config, "to_dict") else None
        described = {"state_dict_keys": keys, "trainable_of": trainable_of,
                     "buffer_names": [name for name, _ in self.module.named_buffers()], "hf_config": hf_config or None,
                     "class": type(self.module).__name__, "peft_config": _peft_config(self.module)}
        if frozen_tied_to:  # a frozen weight under several names (what DeepSpeed's layout records of it)
            described["frozen_tied_to"] = frozen_tied_to
        return described

    def extra_tensors(self, trainable_keys: set[str], keep: bool = True,
                      exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
        """Copies of everything in the state dict that is not a trainable parameter (without frozen
        parameters when ``exclude_frozen``).  Every rank calls it (stage 3 gathers its frozen buckets);
        ranks that do not ``keep`` get an empty dict."""
        gathered: dict[str, torch.Tensor] = {}
        if not exclude_frozen and self.storage is not None:
            for bucket in self._frozen_buckets():
                self.storage.gather(bucket.index, f"save_frozen{bucket.index}")
                if keep:
                    full = self.storage.full[bucket.index]
                    for slot in bucket.slots:
                        gathered[slot.name] = full[slot.offset: slot.offset + slot.numel].view(slot.shape) \
                            .detach().to("cpu", copy=True)
                self.storage.release(bucket.index)
        if not keep:
            return {}
        out: dict[str, torch.Tensor] = {}
        given: set[str] = set()
        for name, t in self.module.state_dict(keep_vars=True).items():
            if name in trainable_keys:
                continue
            frozen_name = self._sharded_frozen_name(t)
            if frozen_name is not None:
                if not exclude_frozen:  # a tied weight: a copy under each of its names
                    value = gathered[frozen_name]
                    out[name] = value.clone() if frozen_name in given else value
                    given.add(frozen_name)
            elif not (exclude_frozen and isinstance(t, nn.Parameter) and not t.requires_grad):
                out[name] = t.detach().to("cpu", copy=True).contiguous()
        return out

    def load_extra(self, values: dict[str, torch.Tensor]) -> None:
        """Copy saved non-trainable tensors back; every rank calls it (stage 3 writes the frozen ones
        into its shards, gathering each bucket that has a saved value)."""
        current = self.module.state_dict(keep_vars=True)
        sharded: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, value in values.items():
                if name not in current:
                    continue
                frozen_name = self._sharded_frozen_name(current[name])
                if frozen_name is not None:
                    sharded[frozen_name] = value
                else:
                    current[name].data.copy_(value)
            if self.storage is not None:
                for bucket in self._frozen_buckets():
                    if not any(slot.name in sharded for slot in bucket.slots):
                        continue
                    self.storage.pin(bucket.index, f"load_frozen{bucket.index}")
                    full = self.storage.full[bucket.index]
                    for slot in bucket.slots:
                        if slot.name in sharded:
                            full[slot.offset: slot.offset + slot.numel].copy_(sharded[slot.name].reshape(-1))
                    self.storage.commit_full(bucket.index)
                    self.storage.unpin(bucket.index)
