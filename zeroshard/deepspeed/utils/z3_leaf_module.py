"""``deepspeed.utils.z3_leaf_module``: mark modules that ZeRO stage 3 gathers whole, as one unit.

Mark before ``initialize()``: the engine plans its stage-3 units from the marks it finds then (see
[Note: leaf modules] in sharding/stage3/units.py).  A mixture-of-experts layer whose experts are chosen
by the data is the usual leaf: ``set_z3_leaf_modules(model, [MoeBlock])``.  Classes are matched by
type (subclasses included) or by name, the class's own or its fully qualified one.  The marks live in
a weak registry, not on the modules: ``z3_leaf_module(module)`` is how to ask for one.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch
from torch import nn

from ...sharding.stage3.units import _LEAVES, is_leaf, mark_leaf
from ...sharding.storage import HOMES

__all__ = ["set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
           "z3_leaf_parameter", "set_z3_leaf_module", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix"]

ClassSpec = Union[type, str]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is marked as a leaf."""
    return is_leaf(model)


def z3_leaf_parameter(model: torch.Tensor) -> bool:
    """Whether the parameter ``model`` belongs to a module marked as a leaf (a stage-3 placeholder
    answers for its parameter)."""
    home = HOMES.home_of(model)
    return any(p is model or (home is not None and HOMES.home_of(p) == home)
               for leaf in list(_LEAVES) for p in leaf.parameters())


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` (itself included) marked as leaves, in ``modules()`` order."""
    return [m for m in model.modules() if is_leaf(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark (``flag=True``) or unmark one module."""
    mark_leaf(model, flag)


def _matches(module: nn.Module, spec: ClassSpec) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    cls = type(module)
    return spec in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _mark_classes(model: nn.Module, leaf_module_classes: Iterable[ClassSpec], flag: bool,
                  raise_if_not_found: bool) -> list[nn.Module]:
    specs = list(leaf_module_classes)
    wrong = [s for s in specs if not isinstance(s, (type, str))]
    if wrong:
        raise TypeError(f"leaf_module_classes must be classes or class names, got {wrong}")
    found = [m for m in model.modules() if any(_matches(m, s) for s in specs)]
    if not found and raise_if_not_found:
        raise ValueError(f"no module of the classes {specs} in the model ({type(model).__name__})")
    for module in found:
        mark_leaf(module, flag)
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Iterable[ClassSpec],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark every module of ``model`` of one of ``leaf_module_classes`` as a leaf; returns them.  None
    found raises ``ValueError`` unless ``raise_if_not_found=False``."""
    return _mark_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Iterable[ClassSpec],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Remove the mark from every module of ``model`` of one of ``leaf_module_classes``; returns them."""
    return _mark_classes(model, leaf_module_classes, False, raise_if_not_found)


def _mark_named(model: nn.Module, wanted: Iterable[str], matches: "type[_NameMatch]", flag: bool,
                raise_if_not_found: bool) -> tuple[list[nn.Module], list[str]]:
    named = list(model.named_modules())
    found: dict[int, nn.Module] = {}
    missing = []
    for pattern in wanted:
        hits = [m for name, m in named if matches.hit(name, pattern)]
        if not hits:
            missing.append(pattern)
        for module in hits:
            mark_leaf(module, flag)
            found.setdefault(id(module), module)
    if missing and raise_if_not_found:
        raise ValueError(f"no module {matches.what} {missing} in the model ({type(model).__name__})")
    return list(found.values()), missing


class _NameMatch:
    what = "named"

    @staticmethod
    def hit(name: str, pattern: str) -> bool:
        return name == pattern


class _SuffixMatch(_NameMatch):
    what = "whose name ends with"

    @staticmethod
    def hit(name: str, pattern: str) -> bool:
        return name.endswith(pattern)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: Iterable[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark (or with ``flag=False`` unmark) the modules named in ``model.named_modules()``; returns
    them and the names that matched none."""
    return _mark_named(model, module_names, _NameMatch, flag, raise_if_not_found)


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: Iterable[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark (or unmark) every module whose ``named_modules()`` name ends with one of the suffixes;
    returns them (each once) and the suffixes that matched none."""
    return _mark_named(model, module_name_suffixes, _SuffixMatch, flag, raise_if_not_found)
