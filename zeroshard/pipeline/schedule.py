"""Pipeline schedules: the ordered forward and backward passes each stage runs for one batch.

A schedule only orders work; pipeline/executor.py runs it, receiving each input just before the pass
that needs it and sending each output as soon as it exists.  Every stage runs its passes of micro-batch
``i`` after the stage before it (forward) or after it (backward) has, and every schedule here runs each
stage's forwards in micro-batch order and its backwards in micro-batch order, so the order of the
messages between two stages is the same on both sides and no stage waits on a stage that waits on it.

[Note: what a schedule costs]
With ``p`` stages and ``m`` micro-batches, both schedules keep each stage idle for ``p - 1`` of the
``m + p - 1`` slots of a batch (the fill and the drain): the bubble ``(p - 1) / (m + p - 1)``.  They
differ in memory: GPipe runs every forward before the first backward, so a stage holds the activations
of all ``m`` micro-batches at once; 1F1B starts the backward of micro-batch ``i`` as soon as it can and
then alternates one forward with one backward, so stage ``s`` holds at most ``p - s`` micro-batches'
activations, whatever ``m``.  Hence 1F1B is the default, and more micro-batches shrink the bubble
without costing memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Forward:
    """Run the stage's layers on micro-batch ``micro_batch`` (its input received or loaded first)."""

    micro_batch: int


@dataclass(frozen=True)
class Backward:
    """Backpropagate micro-batch ``micro_batch`` through the stage (its output gradient received first)."""

    micro_batch: int


Action = Union[Forward, Backward]


class PipeSchedule(ABC):
    """The passes of one batch, per stage."""

    name = ""

    @abstractmethod
    def actions(self, stage: int, num_stages: int, micro_batches: int) -> list[Action]:
        """Stage ``stage``'s passes, in the order it runs them."""

    @staticmethod
    def bubble_fraction(num_stages: int, micro_batches: int) -> float:
        """The share of a batch each stage idles (see [Note: what a schedule costs])."""
        return (num_stages - 1) / (micro_batches + num_stages - 1)


class GPipe(PipeSchedule):
    """Every forward, then every backward."""

    name = "gpipe"

    def actions(self, stage: int, num_stages: int, micro_batches: int) -> list[Action]:
        forwards: list[Action] = [Forward(i) for i in range(micro_batches)]
        return forwards + [Backward(i) for i in range(micro_batches)]


class OneFOneB(PipeSchedule):
    """Forwards until the first backward can run, then one forward and one backward in turn, then the
    remaining backwards."""

    name = "1f1b"

    def actions(self, stage: int, num_stages: int, micro_batches: int) -> list[Action]:
        warmup = min(num_stages - stage - 1, micro_batches)
        out: list[Action] = [Forward(i) for i in range(warmup)]
        for i in range(micro_batches - warmup):
            out += [Forward(warmup + i), Backward(i)]
        out += [Backward(i) for i in range(micro_batches - warmup, micro_batches)]
        return out


class ForwardOnly(PipeSchedule):
    """Evaluation: the forwards alone."""

    name = "forward"

    def actions(self, stage: int, num_stages: int, micro_batches: int) -> list[Action]:
        return [Forward(i) for i in range(micro_batches)]


#: the training schedules by the config's ``pipeline.schedule``
SCHEDULES: dict[str, PipeSchedule] = {s.name: s for s in (OneFOneB(), GPipe())}
