"""The errors of the package's front door that every layer may raise: a feature zeroshard does not
provide (:class:`NotSupportedByZeroshard`, :func:`refuse`) and ``initialize()`` arguments that cannot work
together (:class:`InitializeArgumentError`).  The DeepSpeed face (``deepspeed/refused.py``) re-exports them
under DeepSpeed's paths; the core raises them from here, so that it never imports the face.

[Note: argument errors that are also AssertionErrors]
DeepSpeed checks ``initialize()``'s arguments with ``assert``, so code written for it (its own tests,
training scripts that retry with other arguments) catches ``AssertionError``.  zeroshard's error is a
``ValueError`` like its other refusals of bad input, and also an ``AssertionError``, so that such code
keeps working; the message names the argument and the fix either way.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = ["InitializeArgumentError", "NotSupportedByZeroshard", "refuse"]


class NotSupportedByZeroshard(NotImplementedError):
    """A DeepSpeed feature that zeroshard deliberately does not provide."""


def refuse(feature: str, reason: str, instead: str) -> NoReturn:
    """Raise :class:`NotSupportedByZeroshard` for ``feature``, saying why and what to do instead."""
    raise NotSupportedByZeroshard(f"{feature} is not supported by zeroshard: {reason}. {instead}")


class InitializeArgumentError(ValueError, AssertionError):
    """``initialize()`` got arguments that cannot work (see [Note: argument errors that are also
    AssertionErrors])."""
