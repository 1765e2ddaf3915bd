"""Turn a model's chosen linear layers into FP8 layers: the Python call, and the config's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

from torch import nn

from ..logging import log_rank
from .recipes import float8_config, torchao_float8
from .selection import Selection, select_linears

if TYPE_CHECKING:
    from ..config.fp8_block import FP8Config

__all__ = ["announce", "convert", "convert_from_config", "fp8_layers", "swap"]


def convert(model: nn.Module, recipe: str = "tensorwise", include: Sequence[str] = ("*",),
            exclude: Sequence[str] = (), keep_heads_and_routers: bool = True) -> Selection:
    """Replace ``model``'s chosen ``nn.Linear`` layers, in place, by torchao's FP8 training layers.

    For code that builds and converts its own model (``initialize()`` does the same from the config's
    ``fp8`` block): ``recipe`` is ``"tensorwise"`` or ``"rowwise"``; ``include``/``exclude`` are shell
    patterns over qualified module names ([Note: the layers FP8 leaves in high precision] in
    `fp8/selection.py`). Each layer kept in high precision is logged once, on rank 0.  The layers keep
    their parameters (the same objects), so an optimizer built before still steps them.  Returns what
    was converted and what was kept.
    """
    config = float8_config(recipe)  # the recipe is checked, and torchao found, before the model is looked at
    selection = select_linears(model, include, exclude, keep_heads_and_routers)
    swap(model, config, selection.converted)
    announce(selection, recipe)
    return selection


def swap(model: nn.Module, config: Any, names: Iterable[str]) -> None:
    """Replace the linear layers of ``model`` named ``names`` by torchao's FP8 layers of ``config``."""
    chosen = frozenset(names)
    torchao_float8().convert_to_float8_training(model, config=config,
                                               module_filter_fn=lambda _module, name: name in chosen)


def announce(selection: Selection, recipe: str) -> None:
    """Log each layer kept in high precision, and how many train in FP8 (rank 0)."""
    for name, why in selection.kept:
        log_rank(f"fp8: {name} stays in high precision ({why})")
    log_rank(f"fp8: {len(selection.converted)} linear layers train in FP8 ({recipe})")


def convert_from_config(model: nn.Module, block: "FP8Config") -> Selection | None:
    """The config's ``fp8`` block applied to ``model`` (None when it is off)."""
    if not block.enabled:
        return None
    return convert(model, block.recipe, tuple(block.include), tuple(block.exclude), block.keep_heads_and_routers)


def fp8_layers(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s FP8 layers."""
    return [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"]
