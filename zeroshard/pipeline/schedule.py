"""Pipeline schedules: the ordered forward and backward passes each stage runs for one batch.

A schedule only orders work; pipeline/executor.py runs it, receiving each input just before the pass
that needs it and sending each output as soon as it exists.  A rank may hold several *chunks* of the
model (virtual stages, :class:`InterleavedOneFOneB`): with ``p`` ranks and ``v`` chunks each, the model
is cut into ``p * v`` virtual stages and rank ``r`` holds stages ``r, r + p, r + 2p, ...``, so an
activation goes round the ranks ``v`` times.  Virtual stage ``k`` runs its passes of micro-batch ``i``
after stage ``k - 1`` has (forward) or stage ``k + 1`` has (backward).  Every rank of a schedule runs
its forwards in the same order of (chunk, micro-batch) and its backwards likewise, so the messages
between two ranks in one direction are sent and received in the same order: sends never block
(pipeline/p2p.py), and :func:`timeline` checks that no rank waits on a rank that waits on it.

[Note: what a schedule costs]
With ``p`` stages and ``m`` micro-batches, GPipe and 1F1B keep each stage idle for ``p - 1`` of the
``m + p - 1`` slots of a batch (the fill and the drain): the bubble ``(p - 1) / (m + p - 1)``.  They
differ in memory: GPipe runs every forward before the first backward, so a stage holds the activations
of all ``m`` micro-batches at once; 1F1B starts the backward of micro-batch ``i`` as soon as it can and
then alternates one forward with one backward, so stage ``s`` holds at most ``p - s`` micro-batches'
activations, whatever ``m``.  Hence 1F1B is the default, and more micro-batches shrink the bubble
without costing memory.  Interleaved 1F1B (Megatron-LM's) gives each rank ``v`` chunks of ``1/v`` of its
layers: the fill and the drain are made of chunk passes ``v`` times shorter, so the bubble falls to
``(p - 1) / (v * m + p - 1)``.  The price is ``v`` times as many point-to-point messages (each a
``1/v``-size pass's activation, as large as a whole stage's), a first rank that holds more micro-batches'
activations in flight (its warm-up runs ``(v - 1) * p + 2 * (p - 1)`` chunk forwards, each a ``1/v``
share of a stage's activations) and ``m`` a multiple of ``p``, since the chunks go round the ranks in
groups of ``p`` micro-batches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Union


class ScheduleShapeError(ValueError):
    """A schedule asked for a number of chunks or micro-batches it cannot order."""


@dataclass(frozen=True)
class Forward:
    """Run chunk ``chunk`` of the stage's layers on micro-batch ``micro_batch`` (its input received or
    loaded first)."""

    micro_batch: int
    chunk: int = 0


@dataclass(frozen=True)
class Backward:
    """Backpropagate micro-batch ``micro_batch`` through chunk ``chunk`` (its output gradient received first)."""

    micro_batch: int
    chunk: int = 0


Action = Union[Forward, Backward]


class PipeSchedule(ABC):
    """The passes of one batch, per stage."""

    name = ""
    #: whether the schedule runs several chunks per rank (``PipelineModule(virtual_stages=v)``, v > 1)
    interleaved = False

    @abstractmethod
    def actions(self, stage: int, num_stages: int, micro_batches: int, chunks: int = 1) -> list[Action]:
        """Stage ``stage``'s passes, in the order it runs them."""

    def check(self, num_stages: int, micro_batches: int, chunks: int) -> None:
        """Refuse a shape the schedule cannot order (every rank raises the same error)."""
        if chunks != 1:
            raise ScheduleShapeError(f"pipeline.schedule {self.name!r} runs one chunk per stage, the module has "
                                     f"virtual_stages={chunks}: use the schedule 'interleaved_1f1b'")

    @staticmethod
    def bubble_fraction(num_stages: int, micro_batches: int, chunks: int = 1) -> float:
        """The share of a batch each stage idles (see [Note: what a schedule costs])."""
        return (num_stages - 1) / (chunks * micro_batches + num_stages - 1)


class GPipe(PipeSchedule):
    """Every forward, then every backward."""

    name = "gpipe"

    def actions(self, stage: int, num_stages: int, micro_batches: int, chunks: int = 1) -> list[Action]:
        self.check(num_stages, micro_batches, chunks)
        forwards: list[Action] = [Forward(i) for i in range(micro_batches)]
        return forwards + [Backward(i) for i in range(micro_batches)]


class OneFOneB(PipeSchedule):
    """Forwards until the first backward can run, then one forward and one backward in turn, then the
    remaining backwards."""

    name = "1f1b"

    def actions(self, stage: int, num_stages: int, micro_batches: int, chunks: int = 1) -> list[Action]:
        self.check(num_stages, micro_batches, chunks)
        warmup = min(num_stages - stage - 1, micro_batches)
        out: list[Action] = [Forward(i) for i in range(warmup)]
        for i in range(micro_batches - warmup):
            out += [Forward(warmup + i), Backward(i)]
        out += [Backward(i) for i in range(micro_batches - warmup, micro_batches)]
        return out


class InterleavedOneFOneB(PipeSchedule):
    """1F1B over ``v`` chunks per rank (Megatron-LM's interleaved schedule): the forwards go through the
    chunks in groups of ``p`` micro-batches (chunk 0 of micro-batches 0..p-1, chunk 1 of the same, ...,
    then chunk 0 of micro-batches p..2p-1), the backwards likewise from the last chunk down; after a
    warm-up of forwards, one forward and one backward in turn."""

    name = "interleaved_1f1b"
    interleaved = True

    def check(self, num_stages: int, micro_batches: int, chunks: int) -> None:
        if chunks < 2:
            raise ScheduleShapeError("pipeline.schedule 'interleaved_1f1b' needs a PipelineModule with "
                                     "virtual_stages >= 2 (chunks per rank); with one chunk use '1f1b'")
        if micro_batches % num_stages:
            raise ScheduleShapeError(
                f"pipeline.schedule 'interleaved_1f1b' needs the micro-batches per batch (gradient_accumulation_steps, "
                f"{micro_batches}) to be a multiple of the pipeline stages ({num_stages}): the chunks go round the "
                f"stages in groups of {num_stages} micro-batches")

    @staticmethod
    def _item(k: int, num_stages: int, chunks: int, backward: bool) -> tuple[int, int]:
        """The (micro-batch, chunk) of a rank's ``k``-th forward (or backward)."""
        p = num_stages
        chunk = (k // p) % chunks
        return (k // (p * chunks)) * p + k % p, chunks - 1 - chunk if backward else chunk

    def actions(self, stage: int, num_stages: int, micro_batches: int, chunks: int = 1) -> list[Action]:
        self.check(num_stages, micro_batches, chunks)
        p, total = num_stages, micro_batches * chunks
        warmup = min((p - stage - 1) * 2 + (chunks - 1) * p, total)
        out: list[Action] = [Forward(*self._item(k, p, chunks, False)) for k in range(warmup)]
        for k in range(total - warmup):
            out += [Forward(*self._item(warmup + k, p, chunks, False)), Backward(*self._item(k, p, chunks, True))]
        out += [Backward(*self._item(k, p, chunks, True)) for k in range(total - warmup, total)]
        return out


class ForwardOnly(PipeSchedule):
    """Evaluation: the forwards alone, each micro-batch through every chunk before the next."""

    name = "forward"

    def check(self, num_stages: int, micro_batches: int, chunks: int) -> None:
        """Any shape: forwards alone need no pairing of micro-batches."""

    def actions(self, stage: int, num_stages: int, micro_batches: int, chunks: int = 1) -> list[Action]:
        return [Forward(i, c) for i in range(micro_batches) for c in range(chunks)]


#: the training schedules by the config's ``pipeline.schedule``
SCHEDULES: dict[str, PipeSchedule] = {s.name: s for s in (OneFOneB(), GPipe(), InterleavedOneFOneB())}


class ScheduleDeadlockError(RuntimeError):
    """A schedule in which some rank would wait forever for another."""


def timeline(schedule: PipeSchedule, num_stages: int, micro_batches: int, chunks: int = 1,
             forward_s: float = 1.0, backward_s: float = 2.0) -> list[float]:
    """Each rank's idle share of the batch when every chunk's forward takes ``forward_s / chunks`` and
    its backward ``backward_s / chunks``, messages are instant and sends never block: the schedule's
    theory, which the measured bubble (``BatchTiming``) is compared with.  Raises
    :class:`ScheduleDeadlockError` if the ranks' orders cannot all finish."""
    p, v = num_stages, chunks
    lists = [schedule.actions(r, p, micro_batches, v) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> when it ended
    at, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    while any(at[r] < len(lists[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while at[r] < len(lists[r]):
                action = lists[r][at[r]]
                k = action.chunk * p + r
                if isinstance(action, Forward):
                    need = [("F", k - 1, action.micro_batch)] if k > 0 else []
                    kind, length = "F", forward_s / v
                else:
                    need = [("F", k, action.micro_batch)] + (
                        [("B", k + 1, action.micro_batch)] if k < p * v - 1 else [])
                    kind, length = "B", backward_s / v
                if any(n not in done for n in need):
                    break
                start = max([clock[r]] + [done[n] for n in need])
                clock[r] = done[(kind, k, action.micro_batch)] = start + length
                busy[r] += length
                at[r] += 1
                progressed = True
        if not progressed:
            raise ScheduleDeadlockError(f"{schedule.name} with {p} stages, {micro_batches} micro-batches, {v} chunks: "
                                        f"ranks stop at actions {at}")
    total = max(clock)
    return [(total - b) / total for b in busy]
