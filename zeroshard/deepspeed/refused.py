"""DeepSpeed features zeroshard does not have, refused by name with the reason and what to do instead.

A DeepSpeed script that reaches one of these gets an error at the line that uses it, not an
``AttributeError`` deep inside an import or, worse, a name that accepts its arguments and does
nothing.
"""

from __future__ import annotations

from typing import Any, NoReturn


class NotSupportedByZeroshard(NotImplementedError):
    """A DeepSpeed feature that zeroshard deliberately does not provide."""


def refuse(feature: str, reason: str, instead: str) -> NoReturn:
    raise NotSupportedByZeroshard(f"{feature} is not supported by zeroshard: {reason}. {instead}")


class _Refused:
    feature = ""
    reason = ""
    instead = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse(self.feature, self.reason, self.instead)


class MoE(_Refused):
    feature = "deepspeed.moe.layer.MoE (mixture-of-experts layers, expert parallelism)"
    reason = "zeroshard has no expert parallelism"
    instead = "Use a dense layer, or an MoE layer written in plain PyTorch (its experts are then data parallel)."
