"""The activations a forward leaves saved for backward, measured as autograd saves them.

[Note: what the measured activations count]
``engine.memory_breakdown()["activations"]`` is a measurement, not a formula: the bytes that the last
forward run under ``engine.measure_activations()`` left held for backward, on this rank.  While such a
forward runs, a ``torch.autograd.graph.saved_tensors_hooks`` pair sees every tensor autograd saves
(an operation's inputs and outputs, a custom ``Function``'s ``save_for_backward``); when the forward
returns, each saved tensor still alive is counted by its storage: the storage's whole ``nbytes`` (a
view holds its whole storage; a wrapper subclass such as DTensor, its inner tensors'), each storage
once (a tensor saved by several operations, or views of one tensor, hold it once).  Counted whatever
its device: what the graph holds, not where.
Not counted, because the breakdown counts them elsewhere or the graph does not own them: parameters,
trainable or frozen, and views of them (stage 3's gathered parameters are the parameters
themselves), and anything sharing storage with a parameter or a buffer of the module when the forward
starts (the engine's flat buffers, which the parameters are views of at stages 0-2).
Activation checkpointing is counted as held: a checkpointed region's inner saves go to the
checkpoint's own hooks (the innermost pair of hooks wins), which keep nothing but a placeholder, while
the region's inputs, which the checkpoint keeps (its ``save_inputs``, or ``save_for_backward`` with
``use_reentrant=True``), pass through these hooks and are counted.  Likewise what an activation
offload hook (inner) moves to the host is not counted.  Not seen at all: tensors a custom ``Function``
keeps as plain ``ctx`` attributes instead of saving them.

[Note: activations measured on request]
The measurement is a context, ``engine.measure_activations()``, not a config key: a hook runs on every
saved tensor, so it is asked for where it is wanted (one step, as torch's memory tracker is used) and
costs nothing elsewhere; outside the block no hook is installed, and ``memory_breakdown()`` has no
``activations`` entry before a measured forward.  DeepSpeed's ``memory_breakdown`` key asks for
something else, the allocator's figures printed at every phase of every step, and stays refused, with
a message that names the context.  A compiled engine refuses the context: hooks installed around a
compiled region change what dynamo traces (a graph break, or a recompile), so the figure would be of
another program.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import NotSupportedByZeroshard
from ..sharding.stage3.placeholder import ShardedParameterPlaceholder


class MeasureActivationsError(NotSupportedByZeroshard):
    """``measure_activations()`` where it cannot measure (a compiled engine)."""


def _is_parameter(tensor: torch.Tensor) -> bool:
    base = tensor._base
    return isinstance(tensor, nn.Parameter) or isinstance(base, nn.Parameter)


def _storages(tensor: torch.Tensor) -> Iterator[tuple[int, int]]:
    """(data pointer, bytes) of each storage ``tensor`` holds: its own, or a wrapper subclass's (DTensor's
    local tensor, an FP8 tensor's data and scale) inner tensors' ones."""
    if is_traceable_wrapper_subclass(tensor):
        for name in tensor.__tensor_flatten__()[0]:
            yield from _storages(getattr(tensor, name))
        return
    storage = tensor.untyped_storage()
    yield storage.data_ptr(), storage.nbytes()


def _has_storage(tensor: torch.Tensor) -> bool:
    """False for a meta tensor and a released stage-3 parameter's placeholder (no values)."""
    return not isinstance(tensor, ShardedParameterPlaceholder) and tensor.device.type != "meta"


def held_bytes(saved: list["weakref.ref[torch.Tensor]"], excluded: set[int]) -> int:
    """The bytes of the distinct storages of ``saved``'s tensors still alive, except ``excluded``'s."""
    storages: dict[int, int] = {}
    for ref in saved:
        tensor = ref()
        if tensor is None or tensor.device.type == "meta":
            continue
        storages.update((pointer, nbytes) for pointer, nbytes in _storages(tensor) if pointer not in excluded)
    return sum(storages.values())


class SavedActivations:
    """This rank's saved-for-backward bytes of the last measured forward (see [Note: what the measured
    activations count])."""

    def __init__(self) -> None:
        self._measuring = False
        #: bytes held for backward at the end of the last measured forward; None before one
        self.last_bytes: Optional[int] = None

    @contextlib.contextmanager
    def measuring(self, compiled: bool) -> Iterator[None]:
        """The engine's forwards inside this block are measured."""
        if compiled:
            raise MeasureActivationsError(
                "measure_activations() on a compiled engine: its saved-tensor hooks would change what the "
                "compiled regions trace; measure a step of the same model uncompiled")
        before, self._measuring = self._measuring, True
        try:
            yield
        finally:
            self._measuring = before

    def recording(self, module: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Around the engine's call of ``module``: the hooks while measuring, nothing otherwise."""
        return self._record(module) if self._measuring else contextlib.nullcontext()

    @contextlib.contextmanager
    def _record(self, module: nn.Module) -> Iterator[None]:
        excluded = {pointer for t in (*module.parameters(), *module.buffers()) if _has_storage(t)
                    for pointer, _ in _storages(t)}
        saved: list[weakref.ref[torch.Tensor]] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if not _is_parameter(tensor):
                saved.append(weakref.ref(tensor))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self.last_bytes = held_bytes(saved, excluded)

    def breakdown(self) -> dict[str, float]:
        """``{"activations": bytes}`` once a forward was measured, else nothing."""
        return {} if self.last_bytes is None else {"activations": float(self.last_bytes)}
