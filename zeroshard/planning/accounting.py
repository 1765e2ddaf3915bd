"""Model-state memory: the ZeRO formulas, and what a rank really holds.

[Note: what the breakdown counts]
``params``, ``grads`` and ``optimizer`` count only *real* elements (parameters of the model) that this
rank holds between steps.  Sharded categories hold a rank's chunk of each bucket, so their real size
differs slightly from rank to rank (``real_numel_in_shard``); summed over all ranks they equal the
formula exactly.  Everything else is reported under its own name: ``padding`` (the elements added to
make buckets divisible by N), ``optimizer_other`` (per-tensor scalars such as Adam's ``step``),
``frozen_params``, ``buffers`` (module buffers) and ``comm_buffers`` (stage 2's pool of reusable
gradient-bucket buffers, bounded by ``reduce_bucket_size`` rather than by the model).  With stage 3's
FP8 gathers, ``fp8_gather_buffers`` is the largest gather's packed FP8 chunks (this rank's and every
rank's), held only while that gather runs; the gathered weights themselves are in ``gathered_params``
as without them (dequantised into the buckets' buffers), and FP8 layers cache no FP8 weight.  ZeRO++'s
qwZ is counted the same way under ``qwz_gather_buffers`` (int8 chunks and their scales), and qgZ's
``qgz_buffers`` is what the reductions in flight hold while they run (each bucket's two hops' packed
buffers and its fp32 sums); neither is held between steps.

[Note: hybrid sharding memory]
MiCS (``mics_shard_size: S``) shards the state over groups of S ranks and replicates it across the
groups, so a rank holds what the stage's formula gives for a world of S ranks.  hpZ
(``zero_hpz_partition_size: S``, stage 3) keeps plain stage 3's partition over all N ranks and adds
a *secondary* copy of the compute-dtype parameters partitioned over S ranks: ``Ψ/S * p`` bytes
(``secondary_params``; p = 2 for bf16/fp16, 4 for fp32), the engine's ``secondary_params`` entry.
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
    #: hpZ's secondary partition of the compute-dtype parameters (0 without hpZ)
    secondary_params: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.secondary_params


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


def secondary_param_bytes(num_params: float, partition_size: int, precision: str = "fp32") -> float:
    """hpZ's secondary partition per rank: ``Ψ/S`` compute-dtype parameters (see [Note: hybrid sharding
    memory]); 0 when ``partition_size`` is 1 (hpZ off)."""
    if partition_size <= 1:
        return 0.0
    return PER_PARAM[precision][0] * num_params / partition_size


def hybrid_model_state_bytes(stage: int, num_params: float, world_size: int, precision: str = "fp32",
                             grad_bytes: int | None = None, optimizer_bytes: int | None = None,
                             mics_shard_size: int | None = None,
                             hpz_partition_size: int | None = None) -> StageMemory:
    """:func:`model_state_bytes` with hybrid sharding (see [Note: hybrid sharding memory]).

    ``mics_shard_size`` S (None or -1: off): the formula with N replaced by S.  ``hpz_partition_size``
    S (None or 1: off; stage 3 only): plain stage 3 plus ``secondary_params``.  MiCS wins when both
    are given, as in the engine's groups (``distributed/topology.py``).
    """
    if mics_shard_size is not None and mics_shard_size > 0:
        return model_state_bytes(stage, num_params, mics_shard_size, precision, grad_bytes, optimizer_bytes)
    states = model_state_bytes(stage, num_params, world_size, precision, grad_bytes, optimizer_bytes)
    if hpz_partition_size is not None and hpz_partition_size > 1 and stage == 3:
        return StageMemory(states.params, states.grads, states.optimizer,
                           secondary_param_bytes(num_params, hpz_partition_size, precision))
    return states
