"""The error of ``initialize()`` arguments that cannot work together.

[Note: argument errors that are also AssertionErrors]
DeepSpeed checks these arguments with ``assert``, so code written for it (its own tests, training
scripts that retry with other arguments) catches ``AssertionError``.  zeroshard's error is a
``ValueError`` like its other refusals of bad input, and also an ``AssertionError``, so that such code
keeps working; the message names the argument and the fix either way.
"""

from __future__ import annotations


class InitializeArgumentError(ValueError, AssertionError):
    """``initialize()`` got arguments that cannot work (see [Note: argument errors that are also
    AssertionErrors])."""
