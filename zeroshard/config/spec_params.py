"""Allowed ``params`` of each optimizer and scheduler type, with DeepSpeed's defaults.

Kept apart from :mod:`schema` because these blocks are free-form JSON objects whose allowed keys
depend on ``type``; the builders in :mod:`zeroshard.optim` read their defaults from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

_REQUIRED = object()


@dataclass(frozen=True)
class ParamSpec:
    """One allowed key: its default (or required) and what values it takes."""

    default: Any
    kind: str  # "number", "positive", "non_negative", "bool", "betas", "int_positive", "choice:a|b"

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def problem(self, value: Any) -> str | None:
        if self.kind.startswith("optional_"):
            return None if value is None else ParamSpec(self.default, self.kind[len("optional_"):]).problem(value)
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.kind == "bool":
            return None if isinstance(value, bool) else "true or false"
        if self.kind == "betas":
            ok = (isinstance(value, (list, tuple)) and len(value) == 2
                  and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in value))
            return None if ok else "a list of two numbers in [0, 1)"
        if self.kind.startswith("choice:"):
            choices = self.kind.split(":", 1)[1].split("|")
            return None if value in choices else "one of " + ", ".join(choices)
        if not is_number:
            return "a number"
        if self.kind == "positive" and value <= 0:
            return "a number > 0"
        if self.kind == "non_negative" and value < 0:
            return "a number >= 0"
        if self.kind == "int_positive" and (value <= 0 or int(value) != value):
            return "an integer > 0"
        return None


def resolve(params: dict, spec: dict[str, ParamSpec], where: str) -> dict:
    """Defaults filled in; a missing required key is an error naming ``where``."""

    out = {}
    for name, s in spec.items():
        if name in params:
            out[name] = params[name]
        elif s.required:
            raise ConfigError(f"{where}.{name!r} is required")
        else:
            out[name] = s.default
    return out


_ADAM_COMMON = {
    "lr": ParamSpec(1e-3, "positive"),
    "betas": ParamSpec((0.9, 0.999), "betas"),
    "eps": ParamSpec(1e-8, "positive"),
    "amsgrad": ParamSpec(False, "bool"),
    # DeepSpeed's choice between torch's Adam classes and its fused kernel's: either way the update here is
    # torch's fused one (see [Note: which Adam class the config builds] in optim/builder.py)
    "torch_adam": ParamSpec(False, "bool"),
}

OPTIMIZER_PARAMS: dict[str, dict[str, ParamSpec]] = {
    "Adam": {**_ADAM_COMMON, "weight_decay": ParamSpec(0.0, "non_negative"),
             "adam_w_mode": ParamSpec(True, "bool")},
    "AdamW": {**_ADAM_COMMON, "weight_decay": ParamSpec(0.01, "non_negative")},
    "SGD": {
        "lr": ParamSpec(1e-3, "positive"),
        "momentum": ParamSpec(0.0, "non_negative"),
        "dampening": ParamSpec(0.0, "non_negative"),
        "weight_decay": ParamSpec(0.0, "non_negative"),
        "nesterov": ParamSpec(False, "bool"),
    },
    # DeepSpeed's Muon keys; unset ones take its defaults per kind of group (see [Note: DeepSpeed's Muon
    # split] in optim/muon.py)
    "Muon": {
        "lr": ParamSpec(None, "optional_positive"),
        "muon_lr": ParamSpec(None, "optional_positive"),
        "adam_lr": ParamSpec(None, "optional_positive"),
        "momentum": ParamSpec(None, "optional_non_negative"),
        "weight_decay": ParamSpec(None, "optional_non_negative"),
        "betas": ParamSpec(None, "optional_betas"),
        "eps": ParamSpec(None, "optional_positive"),
        "ns_method": ParamSpec("gram", "choice:gram|standard"),
        # DeepSpeed's choice of Adam class for the rest (torch's or its fused kernel): the same update
        "torch_adam": ParamSpec(False, "bool"),
    },
}

_WARMUP = {
    "warmup_num_steps": ParamSpec(1000, "int_positive"),
    "warmup_type": ParamSpec("log", "choice:log|linear"),
}

SCHEDULER_PARAMS: dict[str, dict[str, ParamSpec]] = {
    "WarmupLR": {"warmup_min_lr": ParamSpec(0.0, "non_negative"),
                 "warmup_max_lr": ParamSpec(None, "optional_non_negative"), **_WARMUP},
    "WarmupDecayLR": {"warmup_min_lr": ParamSpec(0.0, "non_negative"),
                      "warmup_max_lr": ParamSpec(1e-3, "non_negative"), **_WARMUP,
                      "total_num_steps": ParamSpec(_REQUIRED, "int_positive")},
    "WarmupCosineLR": {"total_num_steps": ParamSpec(_REQUIRED, "int_positive"),
                       "warmup_min_ratio": ParamSpec(0.0, "non_negative"),
                       "cos_min_ratio": ParamSpec(1e-4, "non_negative"), **_WARMUP},
    "LRRangeTest": {"lr_range_test_min_lr": ParamSpec(1e-3, "positive"),
                    "lr_range_test_step_size": ParamSpec(2000, "int_positive"),
                    "lr_range_test_step_rate": ParamSpec(1.0, "non_negative"),
                    "lr_range_test_staircase": ParamSpec(False, "bool")},
    "OneCycle": {"cycle_min_lr": ParamSpec(_REQUIRED, "non_negative"), "cycle_max_lr": ParamSpec(_REQUIRED, "non_negative"),
                 "decay_lr_rate": ParamSpec(0.0, "non_negative"), "cycle_first_step_size": ParamSpec(2000, "int_positive"),
                 "cycle_second_step_size": ParamSpec(None, "optional_int_positive"),
                 "cycle_first_stair_count": ParamSpec(0, "non_negative"),
                 "cycle_second_stair_count": ParamSpec(None, "optional_non_negative"),
                 "decay_step_size": ParamSpec(0, "non_negative"), "cycle_momentum": ParamSpec(True, "bool"),
                 "cycle_min_mom": ParamSpec(0.8, "non_negative"), "cycle_max_mom": ParamSpec(0.9, "non_negative"),
                 "decay_mom_rate": ParamSpec(0.0, "non_negative")},
}
