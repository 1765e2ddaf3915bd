"""``deepspeed.runtime.zero.leaf_module_config``: DeepSpeed's default leaf lists and
``DeepSpeedZeroLeafModuleConfig``, a read-only view of the ``zero_optimization.leaf_module`` block (see
[Note: DeepSpeed's config classes as views] in deepspeed/runtime/config.py)."""

from __future__ import annotations

from typing import Any

from ....config.loader import load_config
from ....config.schema import DEFAULT_LEAF_MODULE_CLASSES, LeafModuleConfig
from ..config_utils import BlockView

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES", "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
           "DeepSpeedZeroLeafModuleConfig"]

DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


class DeepSpeedZeroLeafModuleConfig(BlockView):
    """``leaf_module`` under DeepSpeed's class name: ``DeepSpeedZeroLeafModuleConfig(classes=[...])`` parses
    the fields as the config loader does (a lone string is a list of one); ``classes``, ``names`` and
    ``name_suffixes`` read the parsed block."""

    __slots__ = ()
    _block: LeafModuleConfig

    def __init__(self, **fields: Any) -> None:
        super().__init__(load_config({"zero_optimization": {"leaf_module": fields}}).zero_optimization.leaf_module)

    @property
    def classes(self) -> list[str]:
        return list(self._block.classes)

    @property
    def names(self) -> list[str]:
        return list(self._block.names)

    @property
    def name_suffixes(self) -> list[str]:
        return list(self._block.name_suffixes)
