"""The ``fp8`` block: FP8 linear layers (zeroshard/fp8/), declared apart from schema.py's other blocks.

It is zeroshard's own block (DeepSpeed has none); the loader checks it like every other block, and
:func:`check_fp8` relates it to the rest of the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import ConfigError
from .fields import key, strings

__all__ = ["FP8Config", "FP8_RECIPES", "check_fp8"]

#: the scaling recipes of torchao's float8 training that zeroshard offers, by torchao's names
FP8_RECIPES = ("tensorwise", "rowwise")


@dataclass(frozen=True)
class FP8Config:
    """``fp8``: the forward and both backward GEMMs of chosen ``nn.Linear`` layers in FP8 (docs/FP8.md)."""

    enabled: bool = key(
        False, "zeroshard's own block: convert the model's `nn.Linear` layers to FP8 training layers (torchao's "
        "float8 training; docs/FP8.md) in `initialize()`: e4m3 weights and activations, dynamic scales, "
        "higher-precision accumulation and output; masters and optimizer as without it.")
    recipe: Literal["tensorwise", "rowwise"] = key(
        "tensorwise", "`tensorwise`: one scale per tensor, gradients in e5m2; `rowwise`: one scale per row, "
        "gradients in e4m3 (scales rounded down to a power of 2).")
    include: list = key(
        ["*"], "Which `nn.Linear` layers to convert: shell patterns over the module's qualified name "
        "(`layers.*.mlp.*`); a pattern matching no linear layer is an error.", strings)
    exclude: list = key(
        [], "Layers kept in high precision beside the defaults (patterns as `include`; each must match a linear "
        "layer).", strings)
    keep_heads_and_routers: bool = key(
        True, "Keep the output head (`lm_head`, `head`, `output`, `classifier`, `score`) and MoE routers "
        "(`router`, `gate`, `wg`) in high precision unless `include` names one exactly; layers whose dimensions "
        "are not multiples of 16 stay in high precision always (FP8 GEMMs cannot take them). Each kept layer is "
        "logged once.")
    gather_weights_in_fp8: bool = key(
        True, "ZeRO stage 3 with the `tensorwise` recipe: FP8 layers' weights are gathered for forward and "
        "backward in FP8, one byte per element (half of bf16's), with one scale per weight agreed by the shard "
        "group (an all-reduce of the amax), and dequantised into the layer's parameter, where the layer's cast "
        "finds the same FP8 values (docs/FP8.md, \"Stage 3 gathers\"); false: gathered in the parameters' dtype. "
        "Ignored where nothing is gathered (stages 0-2) and where the recipe is `rowwise` (its weight scales "
        "differ per GEMM).")


def check_fp8(block: FP8Config, fp16: bool, hpz: int) -> None:
    """The ``fp8`` keys that depend on the rest of the config (``fp16``: fp16 training is on; ``hpz``: the hpZ
    partition size), refused by name on every rank."""
    if not block.enabled:
        return
    if block.gather_weights_in_fp8 and hpz > 1:
        raise ConfigError("'fp8.gather_weights_in_fp8' with 'zero_optimization.zero_hpz_partition_size' > 1: the "
                          "secondary partition holds weights in their own dtype (not supported); set "
                          "'fp8.gather_weights_in_fp8' to false")
    if fp16:
        raise ConfigError("'fp8.enabled' with 'fp16.enabled': FP8 layers do not compose with fp16's loss scaling "
                          "(not supported); train with 'bf16.enabled' (the natural companion) or in fp32")
    if not block.include:
        raise ConfigError("'fp8.include' is empty: give at least one pattern (\"*\" converts every linear layer)")
