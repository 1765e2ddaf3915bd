"""``gradient_allreduce_op``: its spellings, and the configurations where summing is refused.

DeepSpeed reads the value in any case and refuses ``sum`` where its reduction path always averages
(stage 3) and for two features that zeroshard does not have (ZenFlow, DeepCompile).  Those two are
checked on the raw config, before the strict loader would call their blocks unknown: the user who
asked for both learns about the conflict DeepSpeed would report, rather than only half of it.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from .errors import ConfigError

KEY = "gradient_allreduce_op"
#: the values zeroshard reads, lower case, as DeepSpeed names them
ALLREDUCE_OPS = ("mean", "sum")


def normalize_allreduce_op(raw: dict[str, Any]) -> None:
    """Lower-case the value in ``raw`` (in place); refuse one that is neither ``mean`` nor ``sum``, and
    ``sum`` beside a ZenFlow block or DeepCompile."""
    if KEY not in raw:
        return
    value = raw[KEY]
    op = value.lower() if isinstance(value, str) else value
    if op not in ALLREDUCE_OPS:
        raise ConfigError(f"Invalid {KEY} {json.dumps(value)}: it must be \"mean\" (average the data-parallel "
                          f"ranks' gradients) or \"sum\" (add them), in any case")
    raw[KEY] = op
    if op != "sum":
        return
    zero = raw.get("zero_optimization")
    if isinstance(zero, Mapping) and zero.get("zenflow") is not None:
        raise ConfigError(f"{KEY}='sum' is not supported with ZenFlow; use \"mean\"")
    compile_block = raw.get("compile")
    if isinstance(compile_block, Mapping) and compile_block.get("deepcompile"):
        raise ConfigError(f"{KEY}='sum' is not supported with DeepCompile; use \"mean\"")


def check_allreduce_op(op: str, stage: int) -> None:
    """``sum`` is refused at stage 3, whose reductions DeepSpeed always averages: a config that trains
    there must mean the same under both."""
    if op == "sum" and stage == 3:
        raise ConfigError(f"{KEY}='sum' is not supported with ZeRO stage 3 (the config's "
                          f"'zero_optimization.stage'); use \"mean\" or stage 0-2")
