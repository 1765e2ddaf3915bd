"""Which dtype every piece of training state has, decided once from the config.

[Note: the dtypes of mixed precision]
- ``compute``: the model's parameters (the flat buffer, stage 3's shards and gathered buckets),
  its activations and the gradients autograd produces.  bf16 or fp16; fp32 when mixed precision is off.
- masters: fp32 copies of the parameters *this rank's optimizer updates* (stages 1-3: its shard;
  stage 0: everything), with the optimizer state in fp32 beside them.  After each step the
  16-bit parameters are refreshed from the masters.  Without mixed precision there are no masters:
  the optimizer updates the parameters themselves.
- ``comm``: the dtype gradients are reduced in (``communication_data_type``; default ``compute``,
  which halves the traffic of fp32).
- ``grad_accum``: the dtype gradients are held and accumulate in across micro steps
  (``data_types.grad_accum_dtype``).  Under bf16 the default depends on whether anything
  accumulates: with ``gradient_accumulation_steps`` 1 and ``comm`` bf16 (its default) it is bf16,
  DeepSpeed's default under ZeRO (autograd's gradients are bf16 and they are reduced in bf16, so an
  fp32 buffer would hold the very same values at twice the bytes); with more micro steps, or an fp32
  reduction, it is fp32 (bf16's 8-bit mantissa loses small additions: summing K micro steps'
  gradients, or N ranks' in fp32, is where fp32 pays).  Under fp16 it is fp16 (the loss scale keeps
  fp16 gradients well inside their range, as in DeepSpeed).  The ZeRO paper's 2-bytes-per-parameter
  gradient figures hold when it is the 16-bit dtype; fp32 costs 2 more bytes per gradient element
  held (stages 0-1: every element; stages 2-3: the shard).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import ZeroshardConfig

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def default_grad_accum(compute: str, comm: str, accumulation_steps: Optional[int]) -> str:
    """The dtype gradients are held in when ``data_types.grad_accum_dtype`` is not set (see [Note: the
    dtypes of mixed precision]): the training dtype, except under bf16 where an fp32 buffer would hold
    more than bf16 can: more than one micro step per optimizer step (unset steps mean one, as in the
    batch-size formula), or a reduction in fp32 (``communication_data_type``)."""
    if compute == "bf16" and ((accumulation_steps or 1) > 1 or comm == "fp32"):
        return "fp32"
    return compute


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of one training run (see [Note: the dtypes of mixed precision])."""

    compute: torch.dtype = torch.float32
    comm: torch.dtype = torch.float32
    grad_accum: torch.dtype = torch.float32
    #: DeepSpeed's prescale_gradients: divide by ``predivide_factor`` before the reduction and by
    #: ``world_size / predivide_factor`` after it, instead of by ``world_size`` before (see
    #: [Note: averaging gradients over ranks])
    prescale: bool = False
    predivide_factor: float = 1.0
    #: ``gradient_allreduce_op``: False sums the ranks' gradients instead of averaging them (see
    #: [Note: averaging gradients over ranks])
    average: bool = True

    def before_reduction(self, grad: torch.Tensor, world_size: int) -> None:
        """[Note: averaging gradients over ranks]
        The average over N ranks is a sum of g_i / N.  By default each rank divides by N before the
        sum (the summed values stay the size of one gradient: no overflow in 16 bits).  With
        ``prescale_gradients`` each rank divides by ``gradient_predivide_factor`` f before the sum and
        the result is multiplied by f / N after it, DeepSpeed's knob for keeping fp16 sums in range
        for large N; the result is the same average up to rounding.  ``gradient_allreduce_op: "sum"``
        (``average`` False) divides by nothing, before or after: the reduction's plain sum is the
        gradient, as DeepSpeed gives it for losses that are already normalised over the global batch."""
        grad.div_(self.divisor(world_size))

    def divisor(self, world_size: int) -> float:
        """What each rank divides its gradients by before the sum (see [Note: averaging gradients over ranks])."""
        if not self.average:
            return 1.0
        return self.predivide_factor if self.prescale else world_size

    def store_divided(self, into: torch.Tensor, grad: torch.Tensor, world_size: int, accumulate: bool) -> None:
        """``into = grad / divisor`` (or ``+=`` with ``accumulate``): :meth:`before_reduction` done while
        the gradient is copied into its bucket, one pass over the values instead of two (see [Note:
        filling a stage-2 bucket] in sharding/sharded_grads.py; stages 0-1: [Note: a full gradient buffer
        zeroed where it was not written] in sharding/full_grads.py).  Dividing the copy gives the
        bits dividing the bucket afterwards gives."""
        divisor = self.divisor(world_size)
        if accumulate:  # a second gradient for the same slot in one backward: rare, see the caller
            into.add_(torch.div(grad, divisor).to(into.dtype))
        elif into.dtype == grad.dtype:
            torch.div(grad, divisor, out=into)
        else:
            into.copy_(grad)
            into.div_(divisor)

    def after_reduction(self, reduced: torch.Tensor, world_size: int) -> None:
        """The second half of [Note: averaging gradients over ranks] (nothing by default)."""
        if self.scales_after_reduction:
            reduced.mul_(self.predivide_factor / world_size)

    @property
    def scales_after_reduction(self) -> bool:
        """Whether :meth:`after_reduction` changes the reduced values (prescaled averages only)."""
        return self.prescale and self.average

    @property
    def mixed(self) -> bool:
        """True when the model computes in 16 bits and fp32 master weights exist."""
        return self.compute != torch.float32

    @property
    def name(self) -> str:
        return dtype_name(self.compute)

    @classmethod
    def from_config(cls, config: ZeroshardConfig) -> "PrecisionPolicy":
        compute = "fp16" if config.fp16.enabled else "bf16" if config.bf16.enabled else "fp32"
        comm = config.communication_data_type or compute
        accum = config.data_types.grad_accum_dtype or default_grad_accum(compute, comm,
                                                                         config.gradient_accumulation_steps)
        return cls(DTYPES[compute], DTYPES[comm], DTYPES[accum], config.prescale_gradients,
                   config.gradient_predivide_factor, average=config.gradient_allreduce_op == "mean")
