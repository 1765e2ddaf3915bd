"""``zero_optimization.leaf_module``: the config's way of marking leaf modules (see [Note: leaf
modules] in sharding/stage3/units.py), applied by ``initialize()`` before stage 3 plans its units.

Entries that match nothing are not an error, as in DeepSpeed: the default classes are Hugging Face
mixture-of-experts blocks that most models do not have.  Entries the config chose (anything but the
defaults) that match nothing are logged, since a typo there would otherwise leave a model gathered
child by child without a word.
"""

from __future__ import annotations

import logging

from torch import nn

from ...config.schema import DEFAULT_LEAF_MODULE_CLASSES, LeafModuleConfig
from ...logging import log_rank
from .units import mark_leaf


def _class_named(module: nn.Module, name: str) -> bool:
    cls = type(module)
    return name in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def mark_configured_leaves(model: nn.Module, block: LeafModuleConfig) -> list[nn.Module]:
    """Mark the modules of ``model`` that ``block`` names as leaves; returns them, each once, in
    ``named_modules()`` order."""
    named = list(model.named_modules())
    rules = [("classes", block.classes, lambda path, m, entry: _class_named(m, entry)),
             ("names", block.names, lambda path, m, entry: path == entry),
             ("name_suffixes", block.name_suffixes, lambda path, m, entry: path.endswith(entry))]
    marked: dict[int, nn.Module] = {}
    for key, entries, hit in rules:
        unmatched = []
        for entry in entries:
            found = [m for path, m in named if hit(path, m, entry)]
            if not found:
                unmatched.append(entry)
            for module in found:
                mark_leaf(module)
                marked.setdefault(id(module), module)
        if unmatched and not (key == "classes" and block.classes == DEFAULT_LEAF_MODULE_CLASSES):
            log_rank(f"zero_optimization.leaf_module.{key}: no module of the model matches {unmatched}",
                     level=logging.WARNING)
    return [m for _, m in named if id(m) in marked]
