"""Offload the marked inputs of checkpointed regions, through autograd's saved-tensor hooks.

    offload = CheckpointHiddenStatesOffload()
    with offload:                       # (the with-statement binds nothing: autograd's hooks contract)
        loss = model(batch).loss        # Hugging Face layers mark their hidden states themselves
        loss.backward()

A non-reentrant checkpoint (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, what
transformers uses) saves its region's inputs through the saved-tensor hooks active around it; inside
this context every tensor autograd saves passes the pack hook, and only the ones marked (by
:meth:`CheckpointHiddenStatesOffload.mark`, or by the Hugging Face layer wrap of
:mod:`zeroshard.activations.hf_layer_marker`) are handed to the :class:`ActivationOffloader`, which
moves them to the host; every other saved tensor (the final norm's, the head's, any layer not
checkpointed) is kept as it is.  A mark is used up by the first save of that tensor.  The context
closes after backward: it finishes the copies and forgets every moved tensor (their host buffers stay
pooled for the next step's use of the same object).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from . import hf_layer_marker
from .offload import ActivationOffloader


@dataclass(frozen=True)
class _Moved:
    """What the pack hook saves in place of a moved tensor: its id in the offloader."""

    tensor_id: int


class CheckpointHiddenStatesOffload(ActivationOffloader, saved_tensors_hooks):
    """A context (one ``with`` at a time per object) that moves marked saved tensors to the host; the
    arguments are :class:`ActivationOffloader`'s."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
                 keep_last_count: int = 1) -> None:
        ActivationOffloader.__init__(self, use_pin_memory=use_pin_memory, use_streams=use_streams,
                                     min_offload_bytes=min_offload_bytes, max_fwd_stash_count=max_fwd_stash_count,
                                     max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
                                     keep_last_count=keep_last_count)
        self._allowed: dict[int, int] = {}  # id(tensor) -> marks not yet used
        saved_tensors_hooks.__init__(self, self._pack, self._unpack)

    # ------------------------------------------------------------------ marks
    def mark(self, tensor: torch.Tensor) -> None:
        """Move ``tensor`` to the host when autograd next saves it (each mark covers one save)."""
        self._allowed[id(tensor)] = self._allowed.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def consume_mark(self, tensor: torch.Tensor) -> bool:
        """Use up one mark of ``tensor``; False when it had none."""
        key = id(tensor)
        left = self._allowed.get(key, 0)
        if left <= 0:
            return False
        if left == 1:
            del self._allowed[key]
        else:
            self._allowed[key] = left - 1
        return True

    # ------------------------------------------------------------------ autograd's hooks
    def _pack(self, tensor: torch.Tensor) -> Any:
        self.stats.saved_tensors_seen += 1
        if not self.consume_mark(tensor):
            return tensor
        tensor_id = self.offload_input(tensor)
        return tensor if tensor_id is None else _Moved(tensor_id)

    def _unpack(self, saved: Any) -> torch.Tensor:
        return self._restore(saved.tensor_id, keep=True) if isinstance(saved, _Moved) else saved

    # ------------------------------------------------------------------ lifetime
    def reset(self) -> None:
        super().reset()
        self._allowed.clear()

    def __enter__(self) -> None:
        if self in hf_layer_marker.open_contexts():
            raise RuntimeError("CheckpointHiddenStatesOffload is not re-entrant: open a separate instance for a "
                               "nested context")
        self.reset()
        hf_layer_marker.enter(self)
        try:
            saved_tensors_hooks.__enter__(self)
        except BaseException:
            hf_layer_marker.leave(self)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self._finish_copies()
            self._forget()
            self._allowed.clear()
        finally:
            try:
                hf_layer_marker.leave(self)
            finally:
                saved_tensors_hooks.__exit__(self, *exc)


def get_checkpoint_hidden_states_offloading_ctx_manager(
        use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1) -> CheckpointHiddenStatesOffload:
    """A new :class:`CheckpointHiddenStatesOffload` (DeepSpeed's factory name)."""
    return CheckpointHiddenStatesOffload(use_pin_memory=use_pin_memory, use_streams=use_streams,
                                         min_offload_bytes=min_offload_bytes,
                                         max_fwd_stash_count=max_fwd_stash_count,
                                         max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
                                         keep_last_count=keep_last_count)
