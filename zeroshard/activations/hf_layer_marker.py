"""Mark each Hugging Face checkpointed layer's hidden states for the offload context open on this thread.

A transformers model checkpoints its decoder layers (``GradientCheckpointingLayer`` subclasses) with
the layer's first positional argument, the hidden states, as the region's input: the tensor worth
moving to the host.  While an offload context is open (any number, nested), ``__call__`` of
``GradientCheckpointingLayer`` is wrapped to mark that argument for the innermost one, in training
with gradients on and the layer's ``gradient_checkpointing`` set; when the last context closes, the
class gets its own ``__call__`` back (the model is left as it was, for later uses that expect plain
modules).  Without transformers installed nothing is wrapped, and callers mark tensors themselves.

Only the first positional argument is marked: a layer called with ``hidden_states=`` as a keyword
passes it to the checkpoint inside a ``functools.partial``, which the checkpoint keeps as a Python
reference, never through the saved-tensor hooks, so there is nothing to move.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any, Callable, Optional, Protocol

import torch


class Marker(Protocol):
    """An offload context, as the wrapper sees it."""

    def mark(self, tensor: torch.Tensor) -> None: ...

    def consume_mark(self, tensor: torch.Tensor) -> bool: ...


_LOCAL = threading.local()  # each thread's stack of open contexts (autograd's hooks are per thread too)
_LOCK = threading.Lock()  # the wrap is one class attribute, shared by every thread


class _Wrap:
    """The installed wrap: the wrapper, the class's own ``__call__`` before it (None: inherited), and
    how many open contexts use it."""

    def __init__(self, wrapper: Callable[..., Any], own_call: Optional[Callable[..., Any]]) -> None:
        self.wrapper, self.own_call, self.users = wrapper, own_call, 0


_WRAP: list[Optional[_Wrap]] = [None]


def open_contexts() -> list[Marker]:
    """This thread's open contexts, innermost last."""
    stack: Optional[list[Marker]] = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def current_context() -> Optional[Marker]:
    """The innermost open context of this thread, if any."""
    stack = open_contexts()
    return stack[-1] if stack else None


def _layer_class() -> Any:
    from transformers import GradientCheckpointingLayer  # only where transformers is installed
    return GradientCheckpointingLayer


def _wrap_layer_call() -> _Wrap:
    layer_class = _layer_class()
    own_call = layer_class.__dict__.get("__call__")
    call = layer_class.__call__

    def marking_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        context = current_context()
        marked = None
        if (context is not None and self.training and torch.is_grad_enabled()
                and getattr(self, "gradient_checkpointing", False) and args and torch.is_tensor(args[0])):
            marked = args[0]
            context.mark(marked)
        try:
            return call(self, *args, **kwargs)
        finally:
            if marked is not None and context is not None:
                # a mark the checkpoint did not take must not outlive the call: it is keyed by id(),
                # which a later tensor may reuse
                context.consume_mark(marked)

    layer_class.__call__ = marking_call
    return _Wrap(marking_call, own_call)


def enter(context: Marker) -> None:
    """Open ``context`` on this thread: it becomes the innermost, and the layer call is wrapped."""
    with _LOCK:
        if _WRAP[0] is None and importlib.util.find_spec("transformers") is not None:
            _WRAP[0] = _wrap_layer_call()
        if _WRAP[0] is not None:
            _WRAP[0].users += 1
    open_contexts().append(context)


def leave(context: Marker) -> None:
    """Close ``context``; the last context to close gives the class its own ``__call__`` back."""
    stack = open_contexts()
    if context in stack:  # at most once: a context is never open twice
        stack.remove(context)
    with _LOCK:
        wrap = _WRAP[0]
        if wrap is None:
            return
        wrap.users -= 1
        if wrap.users > 0:
            return
        _WRAP[0] = None
        layer_class = _layer_class()
        if layer_class.__dict__.get("__call__") is not wrap.wrapper:
            return  # someone else wrapped it since: theirs stays
        if wrap.own_call is None:
            delattr(layer_class, "__call__")
        else:
            layer_class.__call__ = wrap.own_call
