"""Model-state memory: the ZeRO formulas, and what a rank really holds.

[Note: what the breakdown counts]
``params``, ``grads`` and ``optimizer`` count only *real* elements (parameters of the model) that this
rank holds between steps.  Sharded categories hold a rank's chunk of each bucket, so their real size
differs slightly from rank to rank (``real_numel_in_shard``); summed over all ranks they equal the
formula exactly.  Everything else is reported under its own name: ``padding`` (the elements added to
make buckets divisible by N), ``optimizer_other`` (per-tensor scalars such as Adam's ``step``),
``frozen_params``, ``buffers`` (module buffers) and ``comm_buffers`` (stage 2's pool of reusable
gradient-bucket buffers, bounded by ``reduce_bucket_size`` rather than by the model).
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes per parameter (params, grads, optimizer state) for Adam, by training precision.
PER_PARAM = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}


@dataclass(frozen=True)
class StageMemory:
    """Per-rank model-state bytes of one stage for ``num_params`` parameters over ``world_size`` ranks."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(stage: int, num_params: float, world_size: int, precision: str = "fp32",
                      grad_bytes: int | None = None, optimizer_bytes: int | None = None) -> StageMemory:
    """The ZeRO paper's formulas for Adam.

    fp32: stage 0 16Ψ; 1: 8Ψ + 8Ψ/N; 2: 4Ψ + 12Ψ/N; 3: 16Ψ/N.  Mixed precision (2 bytes of 16-bit
    parameters, 2 of gradients, 12 of fp32 masters and Adam state): stage 0 16Ψ; 1: 4Ψ + 12Ψ/N;
    2: 2Ψ + 14Ψ/N; 3: 16Ψ/N.  ``grad_bytes`` overrides the gradient element size (4 when a bf16 run
    accumulates gradients in fp32); ``optimizer_bytes`` the optimizer's (12 when fp32 training keeps
    fp32 masters off the device under offload).
    """
    p, g, o = PER_PARAM[precision]
    g = g if grad_bytes is None else grad_bytes
    o = o if optimizer_bytes is None else optimizer_bytes
    n = world_size
    sharded = {0: (False, False, False), 1: (False, False, True), 2: (False, True, True),
               3: (True, True, True)}[stage]
    return StageMemory(*(b * num_params / (n if s else 1) for b, s in zip((p, g, o), sharded)))
