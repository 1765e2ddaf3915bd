"""DeepSpeed features zeroshard does not have, refused by name with the reason and what to do instead.

A DeepSpeed script that reaches one of these gets an error at the line that uses it, not an
``AttributeError`` deep inside an import or, worse, a name that accepts its arguments and does
nothing.
"""

from __future__ import annotations

from typing import NoReturn


class NotSupportedByZeroshard(NotImplementedError):
    """A DeepSpeed feature that zeroshard deliberately does not provide."""


def refuse(feature: str, reason: str, instead: str) -> NoReturn:
    raise NotSupportedByZeroshard(f"{feature} is not supported by zeroshard: {reason}. {instead}")
