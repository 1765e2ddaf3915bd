"""``deepspeed.runtime.config_utils``: the small helpers DeepSpeed code reads a config dict with.

DeepSpeed's ``DeepSpeedConfigModel`` (a pydantic base for declaring config blocks) is not offered:
zeroshard's blocks are the frozen dataclasses of :mod:`zeroshard.config.schema`, and a subclass of a
stand-in that declared no fields would parse nothing.
"""

from __future__ import annotations

import collections
import json
from typing import Any, Iterator, Mapping, Sequence

from ...config.errors import ConfigError

__all__ = ["get_scalar_param", "get_list_param", "get_dict_param", "dict_raise_error_on_duplicate_keys",
           "ScientificNotationEncoder"]


def get_scalar_param(param_dict: Mapping[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when the key is absent."""
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: Mapping[str, Any], param_name: str, param_default_value: Any) -> Any:
    """As :func:`get_scalar_param`, for a list value."""
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: Mapping[str, Any], param_name: str, param_default_value: Any) -> Any:
    """As :func:`get_scalar_param`, for a nested object."""
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """An ``object_pairs_hook`` for ``json.load``: the object as a dict, or a ``ConfigError`` (a
    ``ValueError``, as DeepSpeed raises) naming every key the object repeats, since JSON would otherwise
    keep the last value of a key written twice without a word."""
    counts = collections.Counter(name for name, _ in ordered_pairs)
    repeated = sorted(name for name, count in counts.items() if count > 1)
    if repeated:
        raise ConfigError(f"the config repeats the keys {repeated}; give each key once")
    return dict(ordered_pairs)


class ScientificNotationEncoder(json.JSONEncoder):
    """A JSON encoder (``json.dumps(config, cls=ScientificNotationEncoder)``) that writes numbers above
    1000 in scientific notation (``5.000000e+08``), so bucket sizes in a printed config stay readable;
    objects are written one key per line."""

    def iterencode(self, o: Any, _one_shot: bool = False) -> Iterator[str]:
        yield self._render(o, 1)

    def _render(self, value: Any, depth: int) -> str:
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return json.dumps(value)
        if isinstance(value, (int, float)):
            return f"{value:e}" if value > 1e3 else json.dumps(value)
        indent = " " * (self.indent if isinstance(self.indent, int) else 4)
        if isinstance(value, Mapping):
            items = [f"\n{indent * depth}{json.dumps(str(k))}: {self._render(v, depth + 1)}" for k, v in value.items()]
            return "{" + ",".join(items) + f"\n{indent * (depth - 1)}" + "}"
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(self._render(v, depth + 1) for v in value) + "]"
        return json.dumps(self.default(value))


class BlockView:
    """A read-only view of one parsed config block (``_block``) under DeepSpeed's class names: made from
    keyword arguments through zeroshard's loader by a subclass, or from a parsed block by :meth:`of`."""

    __slots__ = ("_block",)
    _block: Any

    def __init__(self, block: Any) -> None:
        object.__setattr__(self, "_block", block)

    @classmethod
    def of(cls, block: Any) -> Any:
        """The view of an already parsed block."""
        view = cls.__new__(cls)
        BlockView.__init__(view, block)
        return view

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is a read-only view of the parsed config; {name!r} cannot be set")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._block})"
