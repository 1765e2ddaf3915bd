"""The engine's optimizer step at an accumulation boundary: the gradient norm, a skipped step, clipping,
and the update bucket by bucket.

:class:`OptimizerStep` is a part the engine owns, built with the parts it steps (the strategy, the
updater, the optimizer, the loss scaler) and the engine's gradient-norm part (engine/parts.py); it
keeps what one step tells the next: the last norm, the steps skipped in a row, and whether a micro
step since the last step had a non-finite loss.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..checkpoint.background import wait_for_copies
from ..logging import log_rank
from ..offload import OffloadIOError
from ..optim import clip_coefficient
from ..optim.nonfinite import NonFiniteGradientError, first_nonfinite_parameter, ranks_with_nonfinite_loss

if TYPE_CHECKING:
    from ..distributed.collectives import Collectives
    from ..offload.policy import OffloadPolicies
    from ..optim.updater import ShardUpdater
    from ..precision import LossScaler
    from ..sharding import ShardingStrategy
    from .counters import TrainingCounters
    from .parts import GradientNorm


class OptimizerStep:
    """Steps the optimizer over the strategy's buckets (see [Note: one host read per optimizer step])."""

    def __init__(self, strategy: "ShardingStrategy", updater: "ShardUpdater", optimizer: torch.optim.Optimizer,
                 loss_scaler: "LossScaler", counters: "TrainingCounters", offload: "OffloadPolicies",
                 comm: "Collectives", norm: "GradientNorm", param_names: list[str], gradient_clipping: float,
                 max_consecutive_skips: int) -> None:
        self.strategy, self.updater, self.optimizer = strategy, updater, optimizer
        self.loss_scaler, self.counters, self.offload, self.comm = loss_scaler, counters, offload, comm
        #: the engine's gradient-norm part
        self.norm = norm
        self.param_names = param_names
        self.gradient_clipping, self.max_consecutive_skips = gradient_clipping, max_consecutive_skips
        #: the gradient norm of the last optimizer step, before clipping (same on every rank)
        self.grad_norm: Optional[float] = None
        self.consecutive_skips = 0  # non-finite steps in a row (see optim/nonfinite.py)
        # a micro step since the last step had a NaN/inf loss: a device flag, read on a skipped step only
        self.nonfinite_loss: Optional[torch.Tensor] = None

    def saw_loss(self, loss: torch.Tensor) -> None:
        """A micro step's loss (detached): whether it is finite stays on the device."""
        nonfinite = torch.isfinite(loss).logical_not_().any()
        seen = self.nonfinite_loss
        self.nonfinite_loss = nonfinite if seen is None else seen.logical_or_(nonfinite)

    def run(self, lr_scheduler: Optional[LRScheduler]) -> None:
        """[Note: one host read per optimizer step]
        On a GPU every read of a device value on the host (``float()``, ``.item()``, ``bool()``, a
        blocking copy to the CPU) waits until the GPU has run everything queued before it, and the GPU
        then idles while the host queues the next work.  Between two optimizer steps the engine reads
        one value: the global gradient norm, once it is summed over ranks, because whether the step is
        taken at all (a non-finite norm skips it on every rank, see [Note: non-finite gradients] in
        optim/nonfinite.py) decides what the host does next, and torch's optimizers (but the fused
        ones) cannot skip a step on a device flag.  The clipping coefficient and the norm that
        ``get_global_grad_norm()`` returns come with that read.  Everything else stays on the device:
        each bucket's norm (see [Note: the norm stays on the device] in optim/clipping.py), the loss of
        every micro step (read when a log line, ``metrics_record()`` or the user asks for it) and the
        flag of a non-finite loss (read on a skipped step only).  tests/distributed/test_parity.py
        counts the host reads of steady-state steps at every stage.
        """
        # an asynchronous save copies what this step changes (see [Note: asynchronous saves] in
        # checkpoint/background.py)
        wait_for_copies()
        self.strategy.storage.take_back_chunks()  # the optimizer steps the chunks in place
        self.raise_swap_failures()  # a parameter shard that could not be read: stop before updating
        grads = [self.strategy.owned_grad(b) for b in self.strategy.layout.buckets]  # on the device
        shard_comm = self.strategy.comm  # the shard group: replicas (MiCS) hold the same averaged shard
        sharded = self.strategy.traits.grads_are_sharded and shard_comm.world.is_distributed
        # the step's one read of a device value on the host (see [Note: one host read per optimizer step])
        scaled_norm = float(self.norm(grads, shard_comm if sharded else None))
        scale = self.loss_scaler.scale
        self.grad_norm = scaled_norm / scale
        overflow = not math.isfinite(scaled_norm)  # the norm is summed over ranks: every rank sees it
        setattr(self.optimizer, "overflow", overflow)  # DeepSpeed's flag: Accelerate reads it to see a skip
        if overflow:
            self._skip_step(grads)  # see [Note: non-finite gradients] in optim/nonfinite.py
            return
        self.consecutive_skips = 0
        self.nonfinite_loss = None
        self.loss_scaler.update(overflow=False, step=self.counters.global_steps + 1)
        clip = clip_coefficient(self.grad_norm, self.gradient_clipping)
        # fp32: the gradient buffers, clipped in place; masters: fp32 copies (on the host under
        # offload), unscaled and clipped by the factor
        prepared, factor = self.updater.prepare_step(grads, clip, scale)
        step_grads: list[Optional[torch.Tensor]] = list(prepared)
        del grads, prepared  # each bucket's gradients go once it is stepped (see [Note: gradients live
        self._step_and_refresh(step_grads, factor)  # from backward to the step] in sharding/strategy.py)
        self.strategy.zero_grad()
        if lr_scheduler is not None:
            lr_scheduler.step()

    def _skip_step(self, grads: list[torch.Tensor]) -> None:
        """A non-finite gradient norm: parameters, optimizer state and LR schedule stay as they are."""
        counters = self.counters
        step = counters.global_steps + 1
        if self.loss_scaler.checks_overflow:  # fp16: an overflow, handled by the loss scale
            scale = self.loss_scaler.scale
            self.strategy.zero_grad()
            self.loss_scaler.update(overflow=True, step=step)  # raises at the minimum scale
            counters.skipped_steps += 1
            log_rank(f"step {step}: gradient overflow at loss scale {scale:g}, step skipped "
                     f"(loss scale now {self.loss_scaler.scale:g}, {counters.skipped_steps} skipped so far)")
            return
        counters.skipped_steps += 1
        self.consecutive_skips += 1
        ranks = ranks_with_nonfinite_loss(self.comm, self.nonfinite_loss is not None and bool(self.nonfinite_loss))
        self.nonfinite_loss = None
        source = f"non-finite loss on rank(s) {ranks}" if ranks else "every rank's loss was finite: it arose in backward"
        if self.consecutive_skips >= self.max_consecutive_skips:
            name = first_nonfinite_parameter(self.strategy.comm, self.strategy.ranks, self.strategy.layout.buckets,
                                             grads, self.param_names)
            raise NonFiniteGradientError(
                f"{self.consecutive_skips} optimizer steps in a row (up to step {step}) had non-finite "
                f"gradients ({source}; first parameter with a non-finite gradient: {name!r}); training "
                f"stops instead of going on without updates (config key max_consecutive_skips)")
        self.strategy.zero_grad()
        log_rank(f"step {step}: non-finite gradient norm ({source}), step skipped: parameters, optimizer "
                 f"state and LR schedule unchanged ({self.consecutive_skips} in a row, {counters.skipped_steps} "
                 f"skipped so far)", level=logging.WARNING)

    def _step_and_refresh(self, grads: list[Optional[torch.Tensor]], factor: float) -> None:
        """Update the owned chunks bucket by bucket, gathering each one while the next is updated.

        [Note: stepping bucket by bucket]
        A torch optimizer skips parameters whose ``.grad`` is None, so calling ``step()`` once per
        bucket, with only that bucket's chunk holding a gradient, updates each chunk exactly once,
        with the user's own optimizer and its per-tensor state untouched.  What it buys: the
        all-gather of bucket k (stages 1-2) runs while bucket k+1 is being updated, instead of the
        whole gather waiting behind the whole update.  Buckets go in the order the next forward will
        want them (the reverse of the bucket order).

        With fp32 masters (mixed precision, offload) the update reads the bucket's gradient in fp32,
        multiplied by ``factor`` (1 / loss scale, times the clipping coefficient), one piece at a time;
        after each piece the masters are rounded into the parameters (``publish_piece``).
        """
        order = list(reversed(self.strategy.layout.buckets))
        self.updater.begin_step(order)
        for bucket in order:
            grad = grads[bucket.index]
            assert grad is not None
            grads[bucket.index] = None
            self.updater.step_bucket(bucket, grad, factor)
            del grad
            self.strategy.release_grad(bucket)  # its memory goes now, while the gathers run
            self.strategy.refresh_bucket(bucket)
        self.updater.end_step()
        self.strategy.end_refresh()  # stages 1-2: may run on into the next forward
        self.raise_swap_failures()

    def raise_swap_failures(self) -> None:
        """NVMe offload: a swap read or write that failed on any rank stops every rank, together.

        A failing rank keeps issuing the step's collectives (its update stops, see [Note: NVMe
        sub-groups] in optim/nvme_updater.py); here one scalar all-reduce tells every rank, and each raises
        an OffloadIOError: the failing ones with the file and the reason, the others naming them.
        """
        if not self.offload.uses_nvme:
            return
        failures = [f for f in (self.updater.take_failure(), self.strategy.storage.take_failure())
                    if f is not None]
        failed = self.comm.all_reduce_scalar(float(bool(failures)), "offload_io_check") \
            if self.comm.world.is_distributed else float(bool(failures))
        if failures:
            raise failures[0]
        if failed:
            raise OffloadIOError(f"swap I/O failed on {int(failed)} other rank(s) (their error names the file); "
                                 f"this rank stops with them")
