"""Which ``nn.Linear`` layers become FP8 layers: the user's include/exclude patterns and the defaults.

[Note: the layers FP8 leaves in high precision]
FP8 GEMMs take dimensions that are multiples of 16 only, so a linear layer with another in or out
size stays in high precision whatever the patterns say.  By default the output head and MoE routers
stay too: the head's logits feed the loss (a softmax over the vocabulary, where e4m3's three mantissa
bits cost the most) and a router's scores decide which expert a token goes to (a rounding flips
choices), while both are a small part of the model's GEMM time.  A layer is recognised by the last
part of its qualified name (the names Hugging Face models and zeroshard's own MoE gate use), and
``include`` naming one exactly converts it anyway.  Every pattern must match a linear layer, so that
a misspelt name is an error instead of a model silently trained in high precision.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping, Sequence

from torch import nn

from .errors import FP8ConfigError

__all__ = ["HEAD_NAMES", "LinearShape", "ROUTER_NAMES", "Selection", "linear_shapes", "select", "select_linears"]

#: the last name part of an output head
HEAD_NAMES = frozenset({"lm_head", "head", "output", "classifier", "score", "embed_out"})
#: the last name part of an MoE router (zeroshard's and DeepSpeed's gate keeps its linear as ``wg``)
ROUTER_NAMES = frozenset({"router", "gate", "wg"})
#: FP8 GEMMs' dimensions are multiples of this
GEMM_MULTIPLE = 16


@dataclass(frozen=True)
class Selection:
    """The outcome: the qualified names converted, and those kept in high precision with the reason."""

    converted: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]  # (name, why)


@dataclass(frozen=True)
class LinearShape:
    """A linear layer as the selection sees it: its qualified name and its GEMM's sizes."""

    name: str
    in_features: int
    out_features: int


def linear_shapes(model: nn.Module) -> list[LinearShape]:
    """``model``'s ``nn.Linear`` layers not yet FP8 layers, in module order."""
    return [LinearShape(name, module.in_features, module.out_features) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not _is_fp8(module)]


def select_linears(model: nn.Module, include: Sequence[str] = ("*",), exclude: Sequence[str] = (),
                   keep_heads_and_routers: bool = True) -> Selection:
    """The linear layers of ``model`` to convert (see [Note: the layers FP8 leaves in high precision])."""
    return select(linear_shapes(model), include, exclude, keep_heads_and_routers)


def select(linears: Sequence[LinearShape], include: Sequence[str] = ("*",), exclude: Sequence[str] = (),
           keep_heads_and_routers: bool = True, kept_anyway: Mapping[str, str] | None = None) -> Selection:
    """The layers of ``linears`` to convert; ``kept_anyway``: names that stay in high precision whatever the
    patterns say, with the reason."""
    names = [linear.name for linear in linears]
    _every_pattern_matches(names, include, "include")
    _every_pattern_matches(names, exclude, "exclude")
    converted: list[str] = []
    kept: list[tuple[str, str]] = []
    for linear in linears:
        why = _why_kept(linear, include, exclude, keep_heads_and_routers)
        if why is None and kept_anyway and linear.name in kept_anyway:
            why = kept_anyway[linear.name]
        if why is None:
            converted.append(linear.name)
        elif why:
            kept.append((linear.name, why))
    if not converted:
        raise FP8ConfigError(f"'fp8' converts no linear layer of this model (include {list(include)}, exclude "
                             f"{list(exclude)}; kept: {dict(kept) or 'none'}); widen 'fp8.include' or turn "
                             f"'fp8.enabled' off")
    return Selection(tuple(converted), tuple(kept))


def _why_kept(linear: LinearShape, include: Sequence[str], exclude: Sequence[str],
              keep_heads_and_routers: bool) -> str | None:
    """None: convert; "": not asked for (not logged); otherwise why the layer stays in high precision."""
    name = linear.name
    if not any(fnmatch.fnmatchcase(name, p) for p in include):
        return ""
    if linear.in_features % GEMM_MULTIPLE or linear.out_features % GEMM_MULTIPLE:
        return f"dimensions {linear.in_features} x {linear.out_features} are not multiples of {GEMM_MULTIPLE}"
    if any(fnmatch.fnmatchcase(name, p) for p in exclude):
        return "matches 'fp8.exclude'"
    if keep_heads_and_routers and name not in include:
        last = name.rsplit(".", 1)[-1]
        if last in HEAD_NAMES:
            return "an output head"
        if last in ROUTER_NAMES:
            return "an MoE router"
    return None


def _every_pattern_matches(names: list[str], patterns: Sequence[str], key: str) -> None:
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise FP8ConfigError(f"'fp8.{key}' pattern {pattern!r} matches no nn.Linear of the model (its linear "
                                 f"layers: {_sample(names)}); fix the pattern or remove it")


def _sample(names: list[str], shown: int = 6) -> str:
    if not names:
        return "none"
    more = f", ... ({len(names)} in all)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _is_fp8(module: nn.Module) -> bool:
    """Already an FP8 layer (a model converted twice keeps its layers as they are)."""
    return type(module).__name__ == "Float8Linear"
