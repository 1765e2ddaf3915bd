"""Which linear layers a tensor-parallel job splits, and how: the plan, checked against the model.

[Note: where the plan comes from]
As DeepSpeed's AutoTP decides it: the rules of ``tensor_parallel.partition_config.layer_specs`` first,
then, unless ``use_default_specs`` is false, the default rules: ``preset_model``'s, else the model's own
Hugging Face plan (``config.base_model_tp_plan``: ``colwise`` and ``rowwise`` entries; other styles leave
their layers whole), else the decoder plan (attention q/k/v column and o row, MLP gate/up column and
down row).  A rule matches a linear layer's weight by its full name; the first match decides.  A
linear that no rule matches stays whole on every rank (replicated), and the engine lists them once.
A user's pattern that matches no weight is a mistake (a typo, another model's names) and is refused,
as is a split that does not divide a layer's features, or a model's attention heads, by the size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from ..config.schema import TensorParallelConfig
from ..config.tensor_plan import DECODER_RULES, PRESETS, LayerRule, PartitionType, parse_partition_config

#: Hugging Face plan styles that split a linear as zeroshard does
HF_STYLES: dict[str, PartitionType] = {"colwise": "column", "rowwise": "row"}


class TensorPlanError(ValueError):
    """A tensor-parallel plan that does not fit the model: a pattern matching nothing, a size that does
    not divide a layer's features or the attention heads."""


@dataclass(frozen=True)
class TensorPlan:
    """The linear layers split (module name -> ``column`` or ``row``), those left whole, and where the
    rules came from."""

    splits: tuple[tuple[str, PartitionType], ...]
    replicated: tuple[str, ...]
    source: str

    def describe(self, size: int) -> str:
        kept = f"; kept whole on every rank: {', '.join(self.replicated)}" if self.replicated else ""
        return (f"tensor parallel {size}: {len(self.splits)} linear layers split ({self.source})" + kept)


def _hf_rules(model: nn.Module) -> tuple[LayerRule, ...]:
    config = getattr(model, "config", None)
    plan: dict[str, str] = dict(getattr(config, "base_model_tp_plan", None) or {})
    rules = []
    for pattern, style in plan.items():
        kind = HF_STYLES.get(style)
        if kind is None:
            continue
        body = re.escape(pattern).replace(r"\*", r"[^.]+")
        rules.append(LayerRule((rf"(?:.*\.)?{body}\.weight",), kind))
    return tuple(rules)


def _default_rules(model: nn.Module, preset: Optional[str]) -> tuple[tuple[LayerRule, ...], str]:
    if preset is not None:
        return PRESETS[preset], f"preset {preset!r}"
    hf = _hf_rules(model)
    if hf:
        return hf, "the model's base_model_tp_plan"
    return DECODER_RULES, "the decoder plan"


def plan_linears(model: nn.Module, block: TensorParallelConfig) -> TensorPlan:
    """The plan for ``model`` (see [Note: where the plan comes from])."""
    size = block.autotp_size
    custom = parse_partition_config(block.partition_config)
    defaults, source = _default_rules(model, block.preset_model)
    if custom is None:
        rules = defaults
    else:
        rules = custom.rules + (defaults if custom.use_default_specs else ())
        source = "partition_config" + (f", then {source}" if custom.use_default_specs else "")
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    splits: list[tuple[str, PartitionType]] = []
    replicated: list[str] = []
    used: set[str] = set()
    for name, linear in linears:
        weight = f"{name}.weight"
        rule = next((r for r in rules if r.matches(weight)), None)
        if rule is None:
            replicated.append(name)
            continue
        used.update(p for p in rule.patterns if re.fullmatch(p, weight))
        features = linear.out_features if rule.partition_type == "column" else linear.in_features
        if features % size:
            side = "output" if rule.partition_type == "column" else "input"
            raise TensorPlanError(f"{name} ({linear.in_features} -> {linear.out_features}) splits by "
                                  f"{rule.partition_type} over {size} ranks, but its {features} {side} features "
                                  f"are not divisible by {size}")
        splits.append((name, rule.partition_type))
    unmatched = [p for rule in rules if rule.given for p in rule.patterns if p not in used]
    if unmatched:
        raise TensorPlanError(f"tensor_parallel.partition_config: pattern(s) {unmatched} match no linear "
                              f"layer's weight of this {type(model).__name__} (weights are named like "
                              f"{linears[0][0] + '.weight' if linears else 'none: the model has no nn.Linear'})")
    _check_heads(model, size)
    return TensorPlan(tuple(splits), tuple(replicated), source)


def _check_heads(model: nn.Module, size: int) -> None:
    """A Hugging Face model's attention heads (and key/value heads) split with their projections."""
    config: Any = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % size:
            raise TensorPlanError(f"the model's {key} = {heads} is not divisible by tensor_parallel.autotp_size "
                                  f"= {size}: each rank computes whole heads; choose a size that divides it")
