"""``zeroshard estimate``: per-rank memory of stages 0-3 before you launch anything.

The model-state part is :func:`zeroshard.planning.model_state_bytes`, the same function the engine's
``memory_breakdown()`` reports its formula with (and a test checks the two against each other on real
runs).  On top come an activation estimate and the communication buffers the config implies, and the
bytes the parallel layouts exchange.  What is asked (``EstimateRequest``, the layouts' shapes and their
checks) is ``planning/estimate_request.py``'s, imported from here too; the table ``zeroshard estimate``
prints is ``planning/estimate_report.py``'s.

[Note: the activation estimate]
For a transformer layer in 16-bit training, activations take about ``s*b*h*(34 + 5*a*s/h)`` bytes
(sequence s, micro batch b, hidden h, heads a; Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models"); fp32 doubles it.  With activation checkpointing only each layer's input
(``2*s*b*h`` bytes) is kept, plus one layer's full activations during its recomputation.  It is an
estimate, not a measurement.  Attention that never materialises the ``s x s`` scores (flash or
memory-efficient attention, torch's ``scaled_dot_product_attention`` on its fused kernels;
``EstimateRequest.flash_attention``, ``--flash-attention``) keeps none of the ``5*a*s/h`` term: about
``s*b*h*34`` bytes a layer.

[Note: pipeline and expert parallel estimates]
A pipeline of P stages over N ranks (``PipelineShape``) is P stages x N/P data-parallel ranks; each
stage holds Ψ/P parameters (``partition_method="parameters"`` balances them; a tied weight's copies
on later stages are left out) and runs ZeRO over its N/P ranks, so a rank's model states are the
stage formula for Ψ/P over N/P.  The rows are the first stage's, the one with the most activations:
under 1F1B stage s holds min(P - s, m) micro-batches in flight, under GPipe all m (m = gradient
accumulation steps), each with the activations of ceil(layers/P) layers (checkpointed: their
inputs, plus one layer's recomputation at a time).  At ZeRO stage 3 a stage gathers its parameters
once per batch and holds them through it (``pipeline.stage3_gather_per_micro_batch`` false, the
default): its buffers are the stage's whole share in the compute dtype instead of the prefetched
units.  The bubble is (P-1)/(m+P-1) of a step; each
boundary carries m x micro_batch x seq_len x hidden activations forward and as many gradients back,
in the compute dtype.

MoE layers (``MoEShape``, DeepSpeed's ``MoE``) split Ψ into dense Ψ_d and expert Ψ_e (every expert
of every MoE layer; ``num_params`` counts both).  With ``ep_size`` P over N ranks the dense state is
the stage formula for Ψ_d over N, the expert state the formula for Ψ_e/P over the N/P ranks holding
the same experts (see [Note: experts sharded over the ranks that hold them] in experts/groups.py),
and the two add (at stage 3 the experts' parameters too are sharded over those N/P ranks).  Per MoE layer and
micro-batch a rank's dispatch buffer is E x c x hidden elements, c = max(ceil(tokens/E x
capacity_factor (x2 for top-2)), min_capacity) as ``experts/gating.py`` computes it for
tokens = micro_batch x seq_len; the all-to-all sends (P-1)/P of it for the dispatch and again for
the combine, and as much in backward: 4 (P-1)/P E c hidden bytes-per-element.  Activations and
buffers use the dense formulas (the experts' own activations and the exchange buffers are not
counted).

[Note: tensor parallel estimates]
AutoTP (``TensorShape``, ``tensor_parallel.autotp_size`` T) is T tensor-parallel x N/T data-parallel
ranks.  X of the Ψ parameters are split (default: a Llama-style decoder's linear layers, per layer
2h^2 + 2h*h_kv (q, o and k, v; h_kv = h x kv_heads/heads) + 3h*ffn (gate, up, down; ffn default 4h);
biases, norms, embeddings and the head stay whole); a rank holds Ψ_rank = X/T + (Ψ - X) and its model
states are the stage formula for Ψ_rank over its N/T data-parallel ranks.  Activations per layer
follow Korthikanti et al.'s tensor-parallel formula, ``s*b*h*(10 + 24/T + 5*a*s/(h*T))`` bytes in
16-bit (fp32 doubles it): the attention and MLP intermediates split by T, the layer's inputs, norms
and dropout masks (10 s*b*h) stay whole; checkpointed, each layer keeps its whole input.  Traffic:
per layer and micro-batch, forward, one all-reduce of b x s x h elements after each row-parallel
layer (o, down), and backward one per column-parallel layer (q, k, v, gate, up: torch's
``ColwiseParallel`` all-reduces each such layer's input gradient on its own), 7 in all for a Llama
layer; a ring all-reduce sends 2(T-1)/T of its data, so a rank sends 7 x 2(T-1)/T x b s h
bytes-per-element per layer and micro-batch.  These go through DTensor, not the engine's
collectives, and are not in the buffers.  Inside a pipeline of P stages the ranks are T x N/(T P) x P
(``ParallelDims``' order: tensor innermost, pipeline outermost): a rank holds Ψ_rank/P, ZeRO over its
N/(T P) data-parallel ranks, and the activations of ceil(layers/P) layers per micro-batch in flight,
as zeroshard's pipeline engine trains it (``PipeModelDataParallelTopology``); tensor parallelism with
expert parallelism is refused, as zeroshard refuses it in training.

[Note: sequence parallel estimates]
Sequence parallelism (``SequenceShape``) of degree P splits each sequence over P ranks, which hold the
same parameters: ZeRO shards over all of them, so the model states are the data-parallel ones.  Each
rank runs the position-wise parts on s/P positions: ``(s/P)*b*h*34`` bytes per layer in 16-bit.
Ulysses hands each rank all s positions of a/P heads, so the scores add ``5*(a/P)*s^2*b``: per layer
``(s/P)*b*h*(34 + 5*a*s/h)``.  The ring keeps no scores (its backward recomputes each block's), only
one block's ``5*a*(s/P)^2*b`` at a time: ``(s/P)*b*h*34`` per layer plus that once.  Checkpointed, a
layer keeps its input slice, ``2*(s/P)*b*h``.  Traffic per attention layer, micro-batch and rank, in
the compute dtype: Ulysses trades the query, key, value and context slices, sending (P-1)/P of each,
forward and again backward, ``2*(P-1)/P*b*(s/P)*(2h + 2h_kv)`` with h_kv = h x kv_heads/heads (kv
heads fewer than P are repeated to P first: h_kv = h x P/heads); the ring sends ``(3P-2)*B`` with the
key/value block ``B = b*(s/P)*2h_kv`` ([Note: the ring's backward runs the ring again] in
sequence/ring.py counts it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..sharding import STRATEGIES
from ..sharding.layout import capped_bucket_numel
from .accounting import model_state_bytes, secondary_param_bytes
from .estimate_request import (EstimateError, EstimateRequest, ModelShape, MoEShape, PipelineShape, SequenceShape,
                               TensorShape, check_parallel, check_tensor, data_parallel_size, moe_from_hf_config,
                               pipeline_stage_count, tensor_parallel_size, tensor_rank_params)

GB = 1e9  # the seeds' tables use decimal gigabytes

__all__ = ["GB", "StageEstimate", "state_parts", "stage_layers", "activation_bytes", "sequence_exchange_bytes",
           "compute_bytes",
           "pipeline_p2p_bytes", "all_to_all_bytes", "tensor_parallel_bytes", "buffer_bytes", "prefetch_bytes",
           "gathered_stage_bytes", "fp8_gather_buffer_bytes", "gathered_bytes_per_pass", "estimate_stage",
           "estimate_hybrid", "estimate_all", "recommend",
           # estimate_request.py's, imported from here too
           "ModelShape", "EstimateError", "PipelineShape", "MoEShape", "TensorShape", "SequenceShape", "EstimateRequest",
           "moe_from_hf_config", "check_parallel", "check_tensor", "tensor_rank_params", "tensor_parallel_size",
           "pipeline_stage_count", "data_parallel_size"]


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


def state_parts(req: EstimateRequest) -> list[tuple[float, int]]:
    """One rank's model states as (unsharded parameter count, ranks it is sharded over) pairs: the
    whole model over the world; a pipeline stage's share over its data-parallel ranks; a
    tensor-parallel rank's Ψ_rank (a stage's share of it in a pipeline) over its data-parallel ranks;
    with expert parallelism the dense part over the data-parallel ranks and the rank's experts over
    the ranks holding the same experts."""
    psi, n = req.num_params, req.world_size
    if req.tensor is not None:
        return [(tensor_rank_params(req) / pipeline_stage_count(req), data_parallel_size(req))]
    if req.pipeline is not None:
        psi, n = psi / req.pipeline.stages, n // req.pipeline.stages
    if req.moe is not None and req.moe.ep_size > 1:
        ep, experts = req.moe.ep_size, req.moe.total_params
        return [(psi - experts, n), (experts / ep, n // ep)]
    return [(psi, n)]


def stage_layers(req: EstimateRequest) -> Optional[int]:
    """Layers of the (first) pipeline stage: ceil(layers / stages); all of them without a pipeline."""
    layers = req.shape.layers
    if layers is None or req.pipeline is None:
        return layers
    return -(-layers // req.pipeline.stages)


def activation_bytes(req: EstimateRequest) -> float:
    s, b = req.seq_len, req.micro_batch
    h, layers, a = req.shape.hidden, stage_layers(req), req.shape.heads or 1
    if not (s and b and h and layers):
        return 0.0
    scale = 1.0 if req.precision == "mixed" else 2.0
    scores = 0.0 if req.flash_attention else 1.0  # see [Note: the activation estimate]
    if req.sequence is not None and req.sequence.size > 1:
        return _sequence_activation_bytes(req, s, b, h, layers, a, scale)
    if req.tensor is not None:  # see [Note: tensor parallel estimates]
        t = req.tensor.size
        per_layer = s * b * h * (10 + 24 / t + scores * 5 * a * s / (h * t)) * scale
    else:
        per_layer = s * b * h * (34 + scores * 5 * a * s / h) * scale
    in_flight = req.pipeline.in_flight(req.micro_steps) if req.pipeline is not None else 1
    if req.checkpointing:  # one layer recomputes at a time, whatever the micro-batches in flight
        return in_flight * (2 * s * b * h * scale) * layers + per_layer
    return in_flight * per_layer * layers


def _sequence_activation_bytes(req: EstimateRequest, s: int, b: int, h: int, layers: int, a: int,
                               scale: float) -> float:
    """Activations of a rank under sequence parallelism ([Note: sequence parallel estimates])."""
    assert req.sequence is not None
    local = s / req.sequence.size
    if req.sequence.mode == "ring":
        per_layer, once = local * b * h * 34 * scale, 5 * a * local * local * b * scale
    else:
        scores = 0.0 if req.flash_attention else 1.0
        per_layer, once = local * b * h * (34 + scores * 5 * a * s / h) * scale, 0.0
    if req.checkpointing:
        return (2 * local * b * h * scale) * layers + per_layer + once
    return per_layer * layers + once


def sequence_exchange_bytes(req: EstimateRequest) -> Optional[float]:
    """Bytes one rank sends per attention layer per micro-batch for sequence parallelism (forward and
    backward; [Note: sequence parallel estimates]); None without it or without micro batch, sequence
    and hidden."""
    s, b, h, sp = req.seq_len, req.micro_batch, req.shape.hidden, req.sequence
    if sp is None or sp.size == 1 or not (s and b and h):
        return None
    p, heads = sp.size, req.shape.heads
    kv = sp.kv_heads if sp.kv_heads is not None and heads else heads
    local = b * s / p * compute_bytes(req)
    if sp.mode == "ring":
        h_kv = h * kv / heads if kv and heads else h
        return (3 * p - 2) * local * 2 * h_kv
    exchanged_kv = max(kv, p) if kv and kv % p else kv
    h_kv = h * exchanged_kv / heads if exchanged_kv and heads else h
    return 2 * (p - 1) / p * local * (2 * h + 2 * h_kv)


def compute_bytes(req: EstimateRequest) -> int:
    """Bytes of one activation element in the compute dtype."""
    return 2 if req.precision == "mixed" else 4


def pipeline_p2p_bytes(req: EstimateRequest) -> Optional[float]:
    """Bytes crossing one stage boundary per optimizer step: every micro-batch's activation forward
    and its gradient back (None without a pipeline or without micro batch, sequence and hidden)."""
    s, b, h = req.seq_len, req.micro_batch, req.shape.hidden
    if req.pipeline is None or not (s and b and h):
        return None
    return 2 * req.micro_steps * b * s * h * compute_bytes(req)


def all_to_all_bytes(req: EstimateRequest) -> Optional[float]:
    """Bytes one rank sends by all-to-all per MoE layer per micro-batch (dispatch and combine, forward
    and backward); None without MoE layers or without micro batch, sequence and hidden."""
    s, b, h, moe = req.seq_len, req.micro_batch, req.shape.hidden, req.moe
    if moe is None or not (s and b and h):
        return None
    p, e = moe.ep_size, moe.num_experts
    return 4 * (p - 1) * e * moe.capacity(b * s) * h * compute_bytes(req) / p


def tensor_parallel_bytes(req: EstimateRequest) -> Optional[float]:
    """Bytes one rank sends by the tensor-parallel all-reduces per transformer layer per micro-batch
    (forward and backward; [Note: tensor parallel estimates]); None without tensor parallelism or
    without micro batch, sequence and hidden."""
    s, b, h, tp = req.seq_len, req.micro_batch, req.shape.hidden, req.tensor
    if tp is None or not (s and b and h):
        return None
    reduces = tp.row_layers + tp.column_layers
    return reduces * 2 * (tp.size - 1) * b * s * h * compute_bytes(req) / tp.size


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
    return buckets + (prefetch_bytes(req) + fp8_gather_buffer_bytes(req) if stage == 3 else 0.0)


def fp8_gather_buffer_bytes(req: EstimateRequest) -> float:
    """Stage 3's FP8 gathers (``--fp8``): one gather's packed chunks, this rank's and every rank's, one byte
    per element of a prefetched unit (a unit of FP8 layers' weights alone; other parameters' elements
    take their dtype's bytes); the dequantised weights are the prefetched units' own buffers (the memory
    breakdown's ``fp8_gather_buffers``)."""
    if not req.fp8:
        return 0.0
    unit = prefetch_bytes(req) / compute_bytes(req)
    return unit * (req.world_size + 1) / req.world_size


def gathered_bytes_per_pass(req: EstimateRequest) -> tuple[float, float]:
    """The bytes one rank receives gathering every parameter once at stage 3: in the compute dtype, and at
    one byte per element, were every parameter an FP8 layer's weight (``--fp8``)."""
    received = req.num_params * (req.world_size - 1) / req.world_size
    return received * compute_bytes(req), received


def prefetch_bytes(req: EstimateRequest) -> float:
    """Stage 3's gathered units beyond the one in use: it always prefetches the next unit, whatever its
    size ([Note: the next unit is always prefetched] in sharding/stage3/gather_scheduler.py), a
    layer's share where the depth is known."""
    unit = req.num_params / req.shape.layers if req.shape.layers else 0.0
    return min(max(req.prefetch_bucket_size, unit), req.num_params) * compute_bytes(req)


def gathered_stage_bytes(req: EstimateRequest) -> float:
    """A pipeline stage's parameters a rank holds gathered through a batch at ZeRO stage 3 (its share
    of the tensor-parallel split too), in the compute dtype; they take the prefetched units' place."""
    return sum(psi for psi, _ in state_parts(req)) * compute_bytes(req)


def _buffer_view(req: EstimateRequest) -> EstimateRequest:
    """The request as one engine's buckets see it: a pipeline stage's parameters, layers and ranks; with
    expert parallelism the parameters a rank holds, over the data-parallel world; with tensor
    parallelism a rank's Ψ_rank over its data-parallel ranks."""
    parts = state_parts(req)
    if len(parts) == 1 and req.pipeline is None and req.tensor is None:
        return req
    return dataclasses.replace(req, num_params=sum(p for p, _ in parts), world_size=parts[0][1],
                               shape=dataclasses.replace(req.shape, layers=stage_layers(req)),
                               pipeline=None, moe=None, tensor=None)


def estimate_stage(req: EstimateRequest, stage: int) -> StageEstimate:
    """Per-rank memory of one stage.  With ``trainable`` < 1 (a LoRA job) only the trainable fraction has
    gradients and optimizer state; every parameter, frozen or not, is held in the training dtype, sharded
    at stage 3 and whole below (as the engine holds frozen parameters), so ``params`` does not change.
    With a pipeline or MoE layers the model states add up over :func:`state_parts`."""
    params = grads = optimizer = host = masters = 0.0
    for psi, n in state_parts(req):
        states = model_state_bytes(stage, psi, n, req.precision)
        trained = model_state_bytes(stage, psi * req.trainable, n, req.precision, req.grad_bytes)
        params, grads, optimizer = params + states.params, grads + trained.grads, optimizer + trained.optimizer
        masters += 4 * psi * req.trainable / n
    if req.offload in ("optimizer", "params") and stage >= 1:
        host += optimizer
        optimizer = 0.0
        if req.precision == "fp32":  # the offloaded optimizer updates an fp32 copy of the shard (masters)
            host += masters
    if req.offload == "params" and stage == 3:
        host += params
        params = 0.0
    buffers = buffer_bytes(_buffer_view(req), stage)
    if req.pipeline is not None and req.pipeline.holds_gathered_parameters(stage):
        buffers += gathered_stage_bytes(req) - prefetch_bytes(_buffer_view(req))
    return StageEstimate(stage, params, grads, optimizer, activation_bytes(req), buffers, host)


def estimate_hybrid(req: EstimateRequest, stage: int, mics_shard_size: Optional[int] = None,
                    hpz_partition_size: Optional[int] = None) -> StageEstimate:
    """:func:`estimate_stage` with hybrid sharding (see [Note: hybrid sharding memory] in
    planning/accounting.py).

    MiCS (``mics_shard_size`` S, None or -1: off): the stage's estimate for a world of S data-parallel
    ranks, since every sharded byte is split over the S ranks of a shard group.  hpZ
    (``hpz_partition_size`` S, None or 1: off; stage 3): plain stage 3 over all data-parallel ranks plus
    the secondary partition of the rank's parameters, which stays on the device even when ``offload``
    moves the primary one to the host.  With tensor or pipeline parallelism S counts data-parallel
    ranks, and the rank's parameters are its tensor and pipeline share.
    """
    model_parallel = tensor_parallel_size(req) * pipeline_stage_count(req)
    if mics_shard_size is not None and mics_shard_size > 0:
        return estimate_stage(dataclasses.replace(req, world_size=mics_shard_size * model_parallel), stage)
    estimate = estimate_stage(req, stage)
    if hpz_partition_size is not None and hpz_partition_size > 1 and stage == 3:
        rank_params = sum(psi for psi, _ in state_parts(req))
        secondary = secondary_param_bytes(rank_params, hpz_partition_size, req.precision)
        return dataclasses.replace(estimate, secondary_params=secondary)
    return estimate


def estimate_all(req: EstimateRequest) -> list[StageEstimate]:
    return [estimate_stage(req, stage) for stage in range(4)]


def recommend(estimates: list[StageEstimate], gpu_memory_gb: Optional[float], headroom: float = 0.1) -> Optional[int]:
    """The lowest stage whose total fits ``gpu_memory_gb`` with ``headroom`` to spare (None:
    none fits)."""
    if gpu_memory_gb is None:
        return None
    for e in estimates:
        if e.total <= gpu_memory_gb * GB * (1 - headroom):
            return e.stage
    return None
