"""Run one batch's passes on this stage: receive, compute, send, in the order the schedule gives.

The executor knows nothing of ZeRO: it calls the stage engine's forward, backward and step through
:class:`StagePasses`, and the tied weights' exchanges at the points [Note: tied weights across stages]
in pipeline/tied.py names.

[Note: the measured bubble]
Each ``train_batch`` records where this rank's time went (:class:`BatchTiming`, the engine's
``last_batch_timing``): *idle* is the time it waited for another stage, measured with
``time.perf_counter`` around each wait (a few calls per message, always on): blocked in a
point-to-point receive, waiting for its sends at the end of the batch, and in the collectives that
join the stages at the end of a batch (the tied weights' exchanges, the gradient norm's sum over
the stages, the loss handed to every stage), where a stage that finished its passes early
waits for the others.  *Busy* is the rest of the batch: its passes, its data-parallel collectives and
its optimizer step.  The schedule's bubble, ``(p - 1) / (m + p - 1)`` ([Note: what a schedule costs]
in pipeline/schedule.py), is what ``idle / (busy + idle)`` tends to when the stages' passes take
equal time and the step is short beside them.  The times are the host's: on a GPU a receive whose
tensor the host does not read (the gradients) returns before the data has arrived, and its wait then
shows in the pass that uses it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol

import torch

from .p2p import StageLink, as_tensors
from .schedule import Action, Backward, Forward
from .tied import TiedWeights


class NoDataError(RuntimeError):
    """The first or last stage was asked for a micro-batch without a data iterator, or the iterator ran out."""


class StagePasses(Protocol):
    """What the executor asks of the stage's engine."""

    def stage_forward(self, inputs: Any, chunk: int) -> Any: ...

    def stage_backward(self, value: torch.Tensor, is_loss: bool, boundary: bool) -> None:
        """Backpropagate the last stage's loss (``is_loss``), or on an earlier stage the scalar whose
        backward is the vector-Jacobian product with the gradients received, which already carry the
        division by the accumulation steps and the loss scale.  ``boundary``: the batch's last backward
        on this rank, in which the gradients are reduced over the data-parallel group."""

    def stage_last_backward_done(self) -> None:
        """The batch's last backward is over, its step comes next (stage 3 releases what the batch held:
        [Note: a stage's parameters gathered once per batch] in pipeline/engine.py)."""

    def stage_step(self) -> None:
        """A micro-batch's backward is over on this rank (every chunk's): the engine counts a micro step,
        and after the batch's last it steps the optimizer."""


@dataclass
class _InFlight:
    """What a micro-batch leaves on the stage between its forward and its backward."""

    inputs: tuple[torch.Tensor, ...] = ()
    outputs: tuple[torch.Tensor, ...] = ()
    loss: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class BatchTiming:
    """Where one rank's last ``train_batch`` went, in seconds (see [Note: the measured bubble])."""

    #: computing: the stage's passes, its data-parallel collectives, its optimizer step
    busy_s: float
    #: waiting for another stage: ``recv_s + send_s + sync_s``
    idle_s: float
    #: blocked in point-to-point receives
    recv_s: float
    #: waiting for the batch's sends to complete, at its end
    send_s: float
    #: in the collectives joining the stages at the end of the batch (tied weights, norm, loss)
    sync_s: float

    @property
    def total_s(self) -> float:
        return self.busy_s + self.idle_s

    @property
    def idle_fraction(self) -> float:
        """``idle / (busy + idle)``: the measured bubble of this rank."""
        return self.idle_s / self.total_s if self.total_s > 0 else 0.0


class StageClock:
    """One batch's wall time and the waits of :class:`BatchTiming`, on one rank."""

    def __init__(self, link: StageLink) -> None:
        self.link = link
        self.started = time.perf_counter()
        self.sync_s = 0.0
        self._recv_at_start, self._send_at_start = link.recv_seconds, link.send_seconds

    def synced(self, started: float) -> None:
        """A cross-stage collective that began at ``started`` (``time.perf_counter()``) is over."""
        self.sync_s += time.perf_counter() - started

    def timing(self) -> BatchTiming:
        total = time.perf_counter() - self.started
        recv = self.link.recv_seconds - self._recv_at_start
        send = self.link.send_seconds - self._send_at_start
        idle = min(recv + send + self.sync_s, total)
        return BatchTiming(busy_s=total - idle, idle_s=idle, recv_s=recv, send_s=send, sync_s=self.sync_s)


@dataclass
class BatchResult:
    """The last stage's losses (detached) and, if kept, outputs, one per micro-batch."""

    losses: list[torch.Tensor] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)


class BatchRun:
    """One batch on one stage."""

    def __init__(self, passes: StagePasses, link: StageLink, tied: Optional[TiedWeights], micro_batches: int,
                 next_batch: Callable[[], Any], loss_fn: Optional[Callable[..., Any]], training: bool,
                 compute_loss: bool = True, keep_outputs: bool = False, clock: Optional[StageClock] = None,
                 chunks: int = 1) -> None:
        self.passes, self.link, self.tied = passes, link, tied
        #: where the tied weights' exchanges count as waits (see [Note: the measured bubble])
        self.clock = clock
        self.micro_batches = micro_batches
        self.next_batch = next_batch
        self.loss_fn = loss_fn
        self.training, self.compute_loss, self.keep_outputs = training, compute_loss, keep_outputs
        self.chunks = chunks
        self._in_flight: dict[tuple[int, int], _InFlight] = {}
        self.result = BatchResult()

    def _first(self, chunk: int) -> bool:
        """Whether ``chunk`` of this rank is the model's first virtual stage (it reads the inputs)."""
        return self.link.stage == 0 and chunk == 0

    def _last(self, chunk: int) -> bool:
        """Whether ``chunk`` of this rank is the model's last virtual stage (it reads the labels)."""
        return self.link.stage == self.link.num_stages - 1 and chunk == self.chunks - 1

    def run(self, actions: list[Action]) -> BatchResult:
        backwards = [i for i, a in enumerate(actions) if isinstance(a, Backward)]
        final = backwards[-1] if backwards else -1
        try:
            for at, action in enumerate(actions):
                if isinstance(action, Forward):
                    self._forward(action.micro_batch, action.chunk)
                elif isinstance(action, Backward):
                    self._backward(action.micro_batch, action.chunk, at == final)
        finally:
            self.link.wait_sends()
        return self.result

    def _forward(self, index: int, chunk: int) -> None:
        first, last = self._first(chunk), self._last(chunk)
        batch = self.next_batch() if first or last else None
        if first:
            inputs: Any = _inputs_of(batch)
            kept: tuple[torch.Tensor, ...] = ()
        else:
            kept = self.link.recv_forward(self.training)
            inputs = kept[0] if len(kept) == 1 else kept
        outputs = self.passes.stage_forward(inputs, chunk)
        flight = _InFlight(inputs=kept)
        if last:
            if self.compute_loss:
                loss = self.loss_fn(outputs, _labels_of(batch)) if self.loss_fn is not None else outputs
                flight.loss = loss
                self.result.losses.append(loss.detach().float())  # a 16-bit loss is averaged in fp32
            if self.keep_outputs:
                self.result.outputs.append(_detached(outputs))
        else:
            flight.outputs = as_tensors(outputs, f"stage {self.link.stage}'s output")
            self.link.send_forward(flight.outputs)
        if self.training:
            self._in_flight[(index, chunk)] = flight

    def _backward(self, index: int, chunk: int, final: bool) -> None:
        """Micro-batch ``index``'s backward through ``chunk``; ``final``: the batch's last on this rank
        (its chunk 0: every chunk's backward of a micro-batch comes after the later chunks')."""
        flight = self._in_flight.pop((index, chunk))
        if final and self.tied is not None:
            started = time.perf_counter()
            self.tied.before_last_backward()
            self._synced(started)
        if self._last(chunk):
            assert flight.loss is not None
            self.passes.stage_backward(flight.loss, True, final)
        else:
            grads = self.link.recv_backward(flight.outputs)
            terms = [(o * g).sum() for o, g in zip(flight.outputs, grads) if g is not None]
            if not terms:
                raise RuntimeError(f"stage {self.link.stage}'s output needs no gradient: nothing to backpropagate")
            # the vector-Jacobian product as the backward of one scalar; the loss was already divided
            # by the accumulation steps and multiplied by the loss scale on the last stage
            self.passes.stage_backward(torch.stack(terms).sum(), False, final)
        if not self._first(chunk):
            self.link.send_backward(flight.inputs)
        if final and self.tied is not None:
            started = time.perf_counter()
            self.tied.after_last_backward()  # before the step, whose norm waits for every stage
            self._synced(started)
        if final:
            self.passes.stage_last_backward_done()
        if chunk == 0:  # the micro-batch's backward is over on this rank
            self.passes.stage_step()

    def _synced(self, started: float) -> None:
        if self.clock is not None:
            self.clock.synced(started)


def _pair(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise NoDataError(f"a micro-batch must be (inputs, labels), got {type(batch).__name__}")


def _inputs_of(batch: Any) -> Any:
    return _pair(batch)[0]


def _labels_of(batch: Any) -> Any:
    return _pair(batch)[1]


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    return value


def batches_from(iterator: Optional[Iterator[Any]],
                 batch_fn: Optional[Callable[[Any], Any]] = None) -> Callable[[], Any]:
    """``next(iterator)`` (through ``batch_fn``, the engine's ``set_batch_fn``), with a named error when
    there is none or it is exhausted."""
    def next_batch() -> Any:
        batch = _next(iterator)
        return batch_fn(batch) if batch_fn is not None else batch
    return next_batch


def _next(iterator: Optional[Iterator[Any]]) -> Any:
    if iterator is None:
        raise NoDataError("the first and last pipeline stages read the micro-batches: pass data_iter= to "
                          "train_batch()/eval_batch(), call set_dataiterator(), or initialize(training_data=...)")
    try:
        return next(iterator)
    except StopIteration:
        raise NoDataError("the data iterator ran out in the middle of a batch: it must yield "
                          "gradient_accumulation_steps micro-batches per batch (wrap a loader in "
                          "RepeatingLoader to cycle it)") from None
