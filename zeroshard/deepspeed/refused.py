"""DeepSpeed features zeroshard does not have, refused by name with the reason and what to do instead.

A DeepSpeed script that reaches one of these gets an error at the line that uses it, not an
``AttributeError`` deep inside an import or, worse, a name that accepts its arguments and does
nothing.  The error itself is the core's (``zeroshard/errors.py``), which raises it too.
"""

from __future__ import annotations

from typing import Any

from ..errors import NotSupportedByZeroshard, refuse

__all__ = ["NotSupportedByZeroshard", "refuse", "refused_wrapper"]


def refused_wrapper(name: str, message: str, bases: tuple[type, ...] = ()) -> type:
    """A DeepSpeed optimizer-wrapper class, under its name, that cannot be built: ``name(...)`` raises
    :class:`NotSupportedByZeroshard` with ``message``.  zeroshard's engine keeps its masters and shards
    itself and ``engine.optimizer`` is the torch optimizer over the shards, so no engine's optimizer is
    an instance of it: code that imports the name (for ``isinstance`` checks) loads, and the check is false.
    ``bases`` give it methods that work without construction (DeepSpeed's tools call some on an object made
    with ``object.__new__``)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedByZeroshard(message)

    return type(name, bases, {"__init__": __init__, "__doc__": f"Refused: {message}"})
