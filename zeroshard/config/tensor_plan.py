"""The ``tensor_parallel`` block's plan, checked: which linear weights split by column, which by row.

A rule is DeepSpeed's ``layer_specs`` entry: regular expressions matched against a weight's full name
(``model.layers.0.self_attn.q_proj.weight``) and a ``partition_type``.  The first rule that matches a
weight decides it; rules from ``partition_config`` come before the default ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Optional

from .errors import ConfigError

PartitionType = Literal["column", "row"]


@dataclass(frozen=True)
class LayerRule:
    """Weights whose name matches one of ``patterns`` split as ``partition_type``."""

    patterns: tuple[str, ...]
    partition_type: PartitionType
    #: from the user's ``layer_specs`` (a pattern of it that matches nothing is an error)
    given: bool = False

    def matches(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.patterns)


#: the decoder plan: attention q/k/v column and o row, MLP gate/up column and down row (Megatron's split)
DECODER_RULES = (
    LayerRule((r".*\.(q_proj|k_proj|v_proj)\.weight", r".*\.(gate_proj|up_proj)\.weight"), "column"),
    LayerRule((r".*\.(o_proj|down_proj)\.weight",), "row"),
)
PRESETS: dict[str, tuple[LayerRule, ...]] = {"llama": DECODER_RULES, "mistral": DECODER_RULES, "qwen2": DECODER_RULES}


@dataclass(frozen=True)
class PartitionConfig:
    """``tensor_parallel.partition_config``, checked."""

    rules: tuple[LayerRule, ...]
    use_default_specs: bool = True


def parse_partition_config(raw: Optional[dict[str, Any]]) -> Optional[PartitionConfig]:
    """``partition_config`` as rules; a :class:`ConfigError` naming the key for anything malformed."""
    if raw is None:
        return None
    where = "tensor_parallel.partition_config"
    unknown = sorted(set(raw) - {"use_default_specs", "layer_specs"})
    if unknown:
        raise ConfigError(f"unknown config key {where}.{unknown[0]!r}; known keys: layer_specs, use_default_specs")
    use_default = raw.get("use_default_specs", True)
    if not isinstance(use_default, bool):
        raise ConfigError(f"'{where}.use_default_specs' must be true or false")
    specs = raw.get("layer_specs", [])
    if not isinstance(specs, list):
        raise ConfigError(f"'{where}.layer_specs' must be a list of {{patterns, partition_type}} objects")
    rules = []
    for i, spec in enumerate(specs):
        at = f"{where}.layer_specs[{i}]"
        if not isinstance(spec, dict):
            raise ConfigError(f"'{at}' must be an object with 'patterns' and 'partition_type'")
        extra = sorted(set(spec) - {"patterns", "partition_type"})
        if extra:
            raise ConfigError(f"'{at}.{extra[0]}' is not supported: a rule is 'patterns' and 'partition_type' "
                              f"(weights of fused layers split in parts, DeepSpeed's 'shape'/'partition_dim', are not)")
        patterns, kind = spec.get("patterns"), spec.get("partition_type")
        if isinstance(patterns, str):
            patterns = [patterns]
        if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) for p in patterns):
            raise ConfigError(f"'{at}.patterns' must be a non-empty list of regular expressions")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ConfigError(f"'{at}.patterns': {pattern!r} is not a regular expression ({err})") from None
        if kind not in ("column", "row"):
            raise ConfigError(f"'{at}.partition_type' = {kind!r} is not one of column, row")
        rules.append(LayerRule(tuple(patterns), kind, given=True))
    return PartitionConfig(tuple(rules), use_default)


def check_tensor_parallel(block: Any) -> None:
    """The ``tensor_parallel`` keys that need more than their type (called by the config loader)."""
    if block.tp_overlap_comm:
        raise ConfigError("'tensor_parallel.tp_overlap_comm' = true is not supported: zeroshard's tensor-parallel "
                          "all-reduces are torch's DTensor ones, not overlapped with compute; remove the key")
    if block.preset_model is not None and block.preset_model not in PRESETS:
        raise ConfigError(f"'tensor_parallel.preset_model' = {block.preset_model!r} is not one of "
                          f"{', '.join(sorted(PRESETS))}; give 'partition_config.layer_specs' for other models")
    parse_partition_config(block.partition_config)
