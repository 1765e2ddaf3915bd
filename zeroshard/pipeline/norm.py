"""The gradient norm of a pipeline: each stage's norm summed in squares over the stages (an engine part:
``NormAcross`` in engine/parts.py; see [Note: ZeRO inside a pipeline stage] in pipeline/engine.py)."""

from __future__ import annotations

import time
from typing import Optional

import torch

from ..distributed.collectives import Collectives
from .executor import StageClock


class StagesNorm:
    """A stage's norm (over its shards, and its tensor-parallel ranks where it has them) -> the norm of
    every stage's gradients, the same on every rank of the job."""

    def __init__(self, pipe: Collectives, num_stages: int) -> None:
        #: this rank's pipeline: one rank of each stage
        self.pipe = pipe
        self.num_stages = num_stages
        #: the clock of the batch in progress (None between batches): the stages wait for each other
        #: here ([Note: the measured bubble] in pipeline/executor.py)
        self.clock: Optional[StageClock] = None

    def __call__(self, norm: torch.Tensor) -> torch.Tensor:
        if self.num_stages == 1:
            return norm
        squared = norm.square()
        started = time.perf_counter()
        self.pipe.all_reduce(squared, "pipeline_grad_norm")
        if self.clock is not None:
            self.clock.synced(started)
        return squared.sqrt_()
