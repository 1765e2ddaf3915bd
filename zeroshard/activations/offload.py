"""Activation offload: move chosen activations to host buffers as the forward makes them, bring them
back when backward needs them.

A checkpointed region keeps only its inputs, but a deep model keeps one per layer until backward
reaches it; on a GPU those inputs can be parked in host memory.  :class:`ActivationOffloader` does the
moving; who chooses the tensors is its caller (:mod:`zeroshard.activations.hidden_states_offload`:
the inputs marked as a checkpointed layer's hidden states).

[Note: what an offloaded activation's trip costs]
- The newest ``keep_last_count`` tensors are not moved at all: backward starts with the last layer,
  so its input would be copied out and straight back before a copy could even finish.  Each newer
  tensor pushes the oldest kept one out.
- With ``use_streams`` the copy out runs on a side stream that first waits for the compute stream
  (the tensor must be written before it is read), so the forward goes on while it runs;
  ``record_stream`` tells the caching allocator that the side stream still reads the tensor's
  memory, so dropping the last reference does not hand the memory out under the copy.  Up to
  ``max_fwd_stash_count`` of the most recent moved tensors are also kept referenced (the *stash*): a
  backward that reaches one of them takes the device tensor itself and skips the copy back.
- The copy back goes to a fresh tensor with the original's strides (a view keeps its layout, and a
  source's storage offset is not reproduced: the host buffer is dense), on the side stream; the
  compute stream waits for it with an event before any kernel reads it.
- Host buffers are kept in a pool by (shape, dtype, layout, pinned) and reused by later steps, at
  most ``max_cpu_buffer_pool_count`` of them; a buffer goes back to the pool only once the copy that
  reads it has finished (an event per buffer), never while a copy may still read it.
- Not moved (``skipped_marked_tensors``): tensors on a device without streams (the CPU itself:
  there is nowhere cheaper to put them), smaller than ``min_offload_bytes``, parameters and buffers
  (the module holds them anyway), and views whose elements overlap (a stride of 0: the copy back
  could not write them).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from ..device.accelerator import get_accelerator

#: a pooled host buffer fits any tensor of the same shape, dtype and layout (it is dense, so the
#: source's strides do not matter), pinned or not
BufferKey = tuple[tuple[int, ...], torch.dtype, torch.layout, bool]


class ActivationOffloadError(RuntimeError):
    """An offloaded activation asked for after its offloader forgot it (backward after the offload
    context closed or was reset)."""


@dataclass
class OffloadStats:
    """What an offloader did since its last reset."""

    saved_tensors_seen: int = 0  # tensors autograd saved while the hooks were on
    marked_tensors: int = 0  # tensors marked for offload
    offloaded_tensors: int = 0  # copies to the host started
    restored_tensors: int = 0  # moved tensors handed back to backward
    skipped_marked_tensors: int = 0  # marked tensors kept where they are (see the module's note)
    kept_last_tensors: int = 0  # tensors handed back that never left the device (keep_last_count)
    offloaded_bytes: int = 0
    restored_bytes: int = 0


class HostCopy(NamedTuple):
    """A tensor moved to the host: its buffer, and what the copy back needs."""

    host: torch.Tensor
    device: torch.device
    shape: torch.Size
    stride: tuple[int, ...]
    key: BufferKey


def _check_count(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


class ActivationOffloader:
    """Moves activations to host buffers and back, by id (see [Note: what an offloaded activation's
    trip costs]).  :meth:`offload_input` registers a tensor and returns its id (None: not moved);
    :meth:`restore_input` hands it back once; :meth:`reset` finishes the copies and forgets them."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
                 keep_last_count: int = 1) -> None:
        for name, value in (("keep_last_count", keep_last_count), ("max_fwd_stash_count", max_fwd_stash_count),
                            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
                            ("min_offload_bytes", min_offload_bytes)):
            _check_count(name, value)
        self.use_pin_memory = use_pin_memory
        self.min_offload_bytes = min_offload_bytes
        self.max_fwd_stash_count = max_fwd_stash_count
        self.max_cpu_buffer_pool_count = max_cpu_buffer_pool_count
        self.keep_last_count = keep_last_count
        self.stats = OffloadStats()
        self._next_id = 0  # ids count up from 1 after every reset
        self._keep_last: dict[int, torch.Tensor] = {}  # not moved yet, oldest first
        self._tracker: dict[int, HostCopy] = {}  # moved to the host
        self._fwd_stash: dict[int, tuple[torch.Tensor, Any]] = {}  # moved, device tensor still held, copy's event
        self._restored: dict[int, torch.Tensor] = {}  # handed back, for a second backward (retain_graph)
        self._cpu_buffer_pool: dict[BufferKey, list[torch.Tensor]] = {}
        self._cpu_buffer_pool_count = 0
        self._pending_cpu_buffers: list[tuple[BufferKey, torch.Tensor, Any]] = []  # free once the event is done
        accelerator = get_accelerator()
        stream_class = accelerator.Stream
        self.side_stream = stream_class() if use_streams and stream_class is not None else None
        self.use_streams = self.side_stream is not None

    # ------------------------------------------------------------------ host buffers
    def _buffer_key(self, tensor: torch.Tensor) -> BufferKey:
        return tuple(tensor.size()), tensor.dtype, tensor.layout, self.use_pin_memory

    def _pool(self, key: BufferKey, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` for reuse, unless the pool is full (then it is freed)."""
        if self._cpu_buffer_pool_count < self.max_cpu_buffer_pool_count:
            self._cpu_buffer_pool.setdefault(key, []).append(buffer)
            self._cpu_buffer_pool_count += 1

    def _pool_finished(self, wait: bool = False) -> None:
        """Pool the buffers whose copies have finished (``wait``: all of them, waiting)."""
        pending, self._pending_cpu_buffers = self._pending_cpu_buffers, []
        for key, buffer, event in pending:
            if wait:
                event.synchronize()
            if wait or event.query():
                self._pool(key, buffer)
            else:
                self._pending_cpu_buffers.append((key, buffer, event))

    def _empty_cpu_like(self, tensor: torch.Tensor) -> tuple[torch.Tensor, BufferKey]:
        """A dense host buffer for ``tensor``'s values, from the pool when one fits, else new (pinned
        through the accelerator when ``use_pin_memory``, so its pinned total counts it)."""
        self._pool_finished()
        key = self._buffer_key(tensor)
        pooled = self._cpu_buffer_pool.get(key)
        if pooled:
            self._cpu_buffer_pool_count -= 1
            return pooled.pop(), key
        host = torch.empty(tuple(tensor.size()), dtype=tensor.dtype, layout=tensor.layout, device="cpu")
        if self.use_pin_memory:
            host = get_accelerator().pin_memory(host, make_copy=False)
        return host, key

    # ------------------------------------------------------------------ streams
    def _compute_stream(self) -> Any:
        """Looked up at each use: the caller may switch streams after the offloader is built."""
        return get_accelerator().current_stream()

    def _on(self, stream: Any) -> Any:
        return get_accelerator().stream(stream) if stream is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ moving out
    def _should_skip(self, tensor: torch.Tensor) -> bool:
        accelerator = get_accelerator()
        return (accelerator.is_synchronized_device() or not accelerator.on_accelerator(tensor)
                or tensor.element_size() * tensor.nelement() < self.min_offload_bytes
                or isinstance(tensor, (torch.nn.Parameter, torch.nn.Buffer))
                or (tensor.numel() > 1 and 0 in tensor.stride()))

    def offload_input(self, tensor: torch.Tensor) -> Optional[int]:
        """Register ``tensor`` for the trip to the host; its id, or None where it stays (see the note)."""
        if self._should_skip(tensor):
            self.stats.skipped_marked_tensors += 1
            return None
        self._next_id += 1
        newest = self._next_id
        self._keep_last[newest] = tensor
        while len(self._keep_last) > self.keep_last_count:
            oldest = next(iter(self._keep_last))
            self._start_copy_out(oldest, self._keep_last.pop(oldest), newest)
        return newest

    def _start_copy_out(self, tensor_id: int, tensor: torch.Tensor, newest: int) -> None:
        stream = self.side_stream if self.use_streams else self._compute_stream()
        if self.side_stream is not None:
            # the stash holds the newest moved tensors only
            for stashed in [i for i in self._fwd_stash if i <= newest - self.max_fwd_stash_count]:
                del self._fwd_stash[stashed]
            self.side_stream.wait_stream(self._compute_stream())
        with self._on(stream):
            host, key = self._empty_cpu_like(tensor)
            host.copy_(tensor.detach(), non_blocking=self.use_streams)
        self._tracker[tensor_id] = HostCopy(host, tensor.device, tensor.size(), tensor.stride(), key)
        if self.side_stream is not None:
            tensor.record_stream(self.side_stream)
            if self.max_fwd_stash_count > 0:
                self._fwd_stash[tensor_id] = (tensor, self.side_stream.record_event())
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += host.nbytes

    # ------------------------------------------------------------------ bringing back
    def restore_input(self, tensor_id: int) -> torch.Tensor:
        """The tensor registered as ``tensor_id``, handed back once (its id is then forgotten)."""
        return self._restore(tensor_id, keep=False)

    def _restore(self, tensor_id: int, keep: bool) -> torch.Tensor:
        """``keep``: remember what was handed back, so that a second backward over the same graph
        (``retain_graph``) gets the same tensor without a copy; forgotten at reset."""
        if tensor_id in self._restored:
            return self._restored[tensor_id]
        if tensor_id in self._keep_last:
            tensor = self._keep_last.pop(tensor_id)
            self.stats.kept_last_tensors += 1
        elif tensor_id in self._fwd_stash:
            tensor, copied = self._fwd_stash.pop(tensor_id)
            moved = self._tracker.pop(tensor_id)
            self._pending_cpu_buffers.append((moved.key, moved.host, copied))  # free once the copy out is done
            self._count_restored(tensor)
        elif tensor_id in self._tracker:
            tensor = self._copy_back(self._tracker.pop(tensor_id))
            self._count_restored(tensor)
        else:
            raise ActivationOffloadError(f"offloaded activation {tensor_id} is no longer held: backward must run "
                                         f"before its offload context closes (or is reset)")
        if keep:
            self._restored[tensor_id] = tensor
        return tensor

    def _count_restored(self, tensor: torch.Tensor) -> None:
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += tensor.element_size() * tensor.nelement()

    def _copy_back(self, moved: HostCopy) -> torch.Tensor:
        compute = self._compute_stream()
        with self._on(self.side_stream if self.use_streams else compute):
            tensor = torch.empty_strided(moved.shape, moved.stride, dtype=moved.host.dtype, device=moved.device)
            tensor.copy_(moved.host, non_blocking=self.use_streams)
        if self.side_stream is None:
            self._pool(moved.key, moved.host)  # the copy has finished
            return tensor
        copied = self.side_stream.record_event()
        compute.wait_event(copied)
        tensor.record_stream(compute)  # allocated on the side stream, read on the compute stream
        self._pending_cpu_buffers.append((moved.key, moved.host, copied))
        return tensor

    # ------------------------------------------------------------------ lifetime
    def _finish_copies(self) -> None:
        """Wait for every copy in flight, then pool every host buffer no tensor needs any more."""
        if self.side_stream is not None:
            self.side_stream.synchronize()
            self._pool_finished(wait=True)

    def _forget(self) -> None:
        for moved in self._tracker.values():
            self._pool(moved.key, moved.host)
        self._tracker.clear()
        self._fwd_stash.clear()
        self._keep_last.clear()
        self._restored.clear()
        self._pending_cpu_buffers.clear()

    def reset(self) -> None:
        """Finish the copies, forget every registered tensor (the pool stays) and zero the counts."""
        self._finish_copies()
        self._forget()
        self.stats = OffloadStats()
        self._next_id = 0
