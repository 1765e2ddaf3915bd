"""``zeroshard estimate``: per-rank memory of stages 0-3 before you launch anything.

The model-state part is :func:`zeroshard.planning.model_state_bytes`, the same function the engine's
``memory_breakdown()`` reports its formula with (and a test checks the two against each other on real
runs).  On top come an activation estimate and the communication buffers the config implies.

[Note: the activation estimate]
For a transformer layer in 16-bit training, activations take about ``s*b*h*(34 + 5*a*s/h)`` bytes
(sequence s, micro batch b, hidden h, heads a; Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models"); fp32 doubles it.  With activation checkpointing only each layer's input
(``2*s*b*h`` bytes) is kept, plus one layer's full activations during its recomputation.  It is an
estimate, not a measurement: attention implementations that never materialise the ``s x s`` scores
need less.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ..sharding import STRATEGIES
from ..sharding.layout import capped_bucket_numel
from .accounting import model_state_bytes, secondary_param_bytes

GB = 1e9  # the seeds' tables use decimal gigabytes


@dataclass(frozen=True)
class ModelShape:
    """What activations depend on (all optional: without them activations are left out)."""

    hidden: Optional[int] = None
    layers: Optional[int] = None
    heads: Optional[int] = None


@dataclass(frozen=True)
class StageEstimate:
    stage: int
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    host: float = 0.0  # bytes moved to host memory by offload
    #: hpZ's secondary partition of the parameters (see [Note: hybrid sharding memory] in
    #: planning/accounting.py)
    secondary_params: float = 0.0

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers + self.secondary_params


@dataclass(frozen=True)
class EstimateRequest:
    num_params: float
    world_size: int
    precision: str = "mixed"  # "mixed" (bf16/fp16 + fp32 Adam) or "fp32"
    offload: Optional[str] = None  # None, "optimizer" or "params"
    micro_batch: Optional[int] = None
    seq_len: Optional[int] = None
    checkpointing: bool = False
    shape: ModelShape = field(default_factory=ModelShape)
    reduce_bucket_size: float = 5e8
    prefetch_bucket_size: float = 5e7
    #: the fraction of parameters that train (LoRA: ~0.01); the rest are frozen (see estimate_stage)
    trainable: float = 1.0
    #: bytes per gradient element held; None: the precision's (2 mixed, 4 fp32).  4 under bf16 when
    #: gradients accumulate in fp32 ([Note: the dtypes of mixed precision] in precision/policy.py)
    grad_bytes: Optional[int] = None


def activation_bytes(req: EstimateRequest) -> float:
    s, b = req.seq_len, req.micro_batch
    h, layers, a = req.shape.hidden, req.shape.layers, req.shape.heads or 1
    if not (s and b and h and layers):
        return 0.0
    scale = 1.0 if req.precision == "mixed" else 2.0
    per_layer = s * b * h * (34 + 5 * a * s / h) * scale
    if req.checkpointing:
        return (2 * s * b * h * scale) * layers + per_layer
    return per_layer * layers


def buffer_bytes(req: EstimateRequest, stage: int) -> float:
    """Gradient buckets in flight (two, as the engine keeps) plus, at stage 3, the prefetched units."""
    grad_bytes = 2 if req.precision == "mixed" else 4
    if stage == 0:
        return 0.0  # stages 0-1 reduce inside the full gradient buffer
    trainable = int(req.num_params * req.trainable)
    traits = STRATEGIES[stage].traits  # the stage's own bucketing numbers
    bucket = min(capped_bucket_numel(int(req.reduce_bucket_size), trainable, traits.buckets_per_model), trainable)
    # stage 2 never writes a bucket's own chunk (see [Note: stage 2's own chunk is reduced in place] in
    # sharding/grad_chunks.py)
    written = (req.world_size - 1) / req.world_size if stage == 2 else 1.0
    buckets = 2 * bucket * grad_bytes * written if stage >= 2 else 0.0
    # stage 3 always prefetches the next unit, whatever its size ([Note: the next unit is always
    # prefetched] in sharding/stage3/gather_scheduler.py): a layer's share where the depth is known
    unit = req.num_params / req.shape.layers if req.shape.layers else 0.0
    prefetch = min(max(req.prefetch_bucket_size, unit), req.num_params) * grad_bytes if stage == 3 else 0.0
    return buckets + prefetch


def estimate_stage(req: EstimateRequest, stage: int) -> StageEstimate:
    """Per-rank memory of one stage.  With ``trainable`` < 1 (a LoRA job) only the trainable fraction has
    gradients and optimizer state; every parameter, frozen or not, is held in the training dtype, sharded
    at stage 3 and whole below (as the engine holds frozen parameters), so ``params`` does not change."""
    states = model_state_bytes(stage, req.num_params, req.world_size, req.precision)
    trained = model_state_bytes(stage, req.num_params * req.trainable, req.world_size, req.precision, req.grad_bytes)
    params, grads, optimizer, host = states.params, trained.grads, trained.optimizer, 0.0
    if req.offload in ("optimizer", "params") and stage >= 1:
        host += optimizer
        optimizer = 0.0
        if req.precision == "fp32":  # the offloaded optimizer updates an fp32 copy of the shard (masters)
            host += 4 * req.num_params * req.trainable / req.world_size
    if req.offload == "params" and stage == 3:
        host += params
        params = 0.0
    return StageEstimate(stage, params, grads, optimizer, activation_bytes(req), buffer_bytes(req, stage), host)


def estimate_hybrid(req: EstimateRequest, stage: int, mics_shard_size: Optional[int] = None,
                    hpz_partition_size: Optional[int] = None) -> StageEstimate:
    """:func:`estimate_stage` with hybrid sharding (see [Note: hybrid sharding memory] in
    planning/accounting.py).

    MiCS (``mics_shard_size`` S, None or -1: off): the stage's estimate for a world of S ranks, since
    every sharded byte is split over the S ranks of a shard group.  hpZ (``hpz_partition_size`` S, None
    or 1: off; stage 3): plain stage 3 over all ranks plus the secondary partition, which stays on the
    device even when ``offload`` moves the primary one to the host.
    """
    if mics_shard_size is not None and mics_shard_size > 0:
        return estimate_stage(dataclasses.replace(req, world_size=mics_shard_size), stage)
    estimate = estimate_stage(req, stage)
    if hpz_partition_size is not None and hpz_partition_size > 1 and stage == 3:
        secondary = secondary_param_bytes(req.num_params, hpz_partition_size, req.precision)
        return dataclasses.replace(estimate, secondary_params=secondary)
    return estimate


def estimate_all(req: EstimateRequest) -> list[StageEstimate]:
    return [estimate_stage(req, stage) for stage in range(4)]


def recommend(estimates: list[StageEstimate], gpu_memory_gb: Optional[float], headroom: float = 0.1) -> Optional[int]:
    """The lowest stage whose total fits ``gpu_memory_gb`` with ``headroom`` to spare (None: none fits)."""
    if gpu_memory_gb is None:
        return None
    for e in estimates:
        if e.total <= gpu_memory_gb * GB * (1 - headroom):
            return e.stage
    return None


def format_table(req: EstimateRequest, estimates: list[StageEstimate], gpu_memory_gb: Optional[float]) -> str:
    precision = "mixed precision (16-bit params/grads, fp32 Adam)" if req.precision == "mixed" else "fp32 (Adam)"
    held_in_fp32 = req.precision == "mixed" and req.grad_bytes == 4
    lines = [f"{req.num_params:.3g} parameters, {req.world_size} ranks, {precision}"
             + (", gradients held in fp32" if held_in_fp32 else "")
             + (f", offload {req.offload}" if req.offload else "")
             + (f", {req.trainable:g} of them trainable (the rest frozen)" if req.trainable < 1 else "")
             + "; per rank, decimal GB",
             "",
             "| stage | params | grads | optimizer | model states | activations | buffers | total | host (offload) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in estimates:
        lines.append(f"| {e.stage} | {e.params / GB:g} | {e.grads / GB:g} | {e.optimizer / GB:g} | "
                     f"{e.model_states / GB:g} | {e.activations / GB:.4g} | {e.buffers / GB:.4g} | "
                     f"{e.total / GB:.4g} | {e.host / GB:g} |")
    if gpu_memory_gb is not None:
        best = recommend(estimates, gpu_memory_gb)
        lines.append("")
        lines.append(f"recommendation: ZeRO stage {best} is the lowest that fits {gpu_memory_gb:g} GB with 10% headroom"
                     if best is not None else
                     f"recommendation: no stage fits {gpu_memory_gb:g} GB; add ranks, offload, or checkpoint activations")
    return "\n".join(lines)
