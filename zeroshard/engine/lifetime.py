"""An engine's hold on its model: one live engine per model, and a model that must not change under it."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

#: model -> the live engine that wraps it (see [Note: an engine's lifetime])
ENGINE_OF: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[Any]]" = weakref.WeakKeyDictionary()


class ModelAlreadyWrappedError(RuntimeError):
    """``initialize()`` on a model that a live engine still wraps."""


class ModelChangedError(RuntimeError):
    """The wrapped model gained or lost parameters after ``initialize()`` (``get_peft_model``, a new
    head): the engine would neither gather, reduce nor update them."""


def refuse_a_wrapped_model(model: nn.Module) -> None:
    """[Note: an engine's lifetime]
    An engine takes the model over: its parameters become views into zeroshard's storage, and
    hooks on its parameters and (stage 3) modules drive the reductions and gathers.  A model can
    be wrapped by one live engine at a time: ``initialize()`` on a model that is still wrapped
    raises :class:`ModelAlreadyWrappedError`.  ``engine.close()`` hands it back: every hook
    removed, every parameter a plain tensor of its own holding its current full values (at stage
    3 a gather, so every rank calls it), and a new ``initialize()`` on it works.
    """
    previous = ENGINE_OF.get(model)
    if previous is not None and previous() is not None:
        raise ModelAlreadyWrappedError(
            f"this {type(model).__name__} is already wrapped by a zeroshard engine: call engine.close() on "
            f"that engine first (it hands the model back with its current weights), then initialize() again")


def check_unchanged(model: nn.Module, taken_over: list[str]) -> None:
    """Refuse a model whose parameters changed since ``initialize()`` took them over (``taken_over``: their
    names then): a silent half-trained model otherwise (the new parameters get gradients nobody reduces
    or applies)."""
    names = [name for name, _ in model.named_parameters()]
    if names != taken_over:
        added = sorted(set(names) - set(taken_over))[:5]
        removed = sorted(set(taken_over) - set(names))[:5]
        raise ModelChangedError(
            f"the model's parameters changed after initialize() (added {added}, removed {removed}): "
            f"change the model (get_peft_model, resize_token_embeddings, a new head) before initialize(), "
            f"or engine.close() and initialize() again")
