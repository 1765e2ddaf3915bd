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
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

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


class EstimateError(ValueError):
    """A parallel layout the estimate (and zeroshard) cannot use: a size that does not divide the
    ranks or the experts, an unsupported combination."""


def _schedules() -> dict[str, Any]:
    """The pipeline's schedules by name, imported when first needed: the pipeline package imports the
    engine, which imports this module's accounting."""
    from ..pipeline.schedule import SCHEDULES

    return SCHEDULES


@dataclass(frozen=True)
class PipelineShape:
    """Pipeline parallelism: ``stages`` P, ``schedule`` "1f1b", "gpipe" or "interleaved_1f1b" with
    ``chunks`` v per stage (see [Note: pipeline and expert parallel estimates]); the micro-batches m of a
    step are ``EstimateRequest.micro_steps``."""

    stages: int
    schedule: str = "1f1b"
    #: ``pipeline.stage3_gather_per_micro_batch``: False (zeroshard's default) gathers a stage's
    #: parameters once per batch at ZeRO stage 3 and holds them through it
    gather_per_micro_batch: bool = False
    #: chunks of layers per stage (``PipelineModule(virtual_stages=v)``, the interleaved schedule)
    chunks: int = 1

    def holds_gathered_parameters(self, stage: int) -> bool:
        """Whether a ZeRO ``stage`` engine of a pipeline stage holds its parameters gathered for the whole
        batch (see [Note: a stage's parameters gathered once per batch] in pipeline/engine.py)."""
        return stage == 3 and self.stages > 1 and not self.gather_per_micro_batch

    def bubble(self, micro_batches: int) -> float:
        """The fraction of a step each stage idles while the pipeline fills and drains."""
        return _schedules()[self.schedule].bubble_fraction(self.stages, micro_batches, self.chunks)

    def in_flight(self, micro_batches: int, stage_index: int = 0) -> float:
        """Micro-batches whose activations stage ``stage_index`` holds at once (with chunks, each chunk's
        share counts ``1/chunks``): the schedule's own order of passes, counted."""
        from ..pipeline.schedule import Forward

        live = peak = 0
        for action in _schedules()[self.schedule].actions(stage_index, self.stages, micro_batches, self.chunks):
            live += 1 if isinstance(action, Forward) else -1
            peak = max(peak, live)
        return peak / self.chunks


@dataclass(frozen=True)
class MoEShape:
    """MoE layers as DeepSpeed's ``MoE``: ``num_experts`` E of ``expert_params`` parameters each in
    each of ``moe_layers`` layers, ``ep_size`` P, top-``topk`` routing (see [Note: pipeline and expert
    parallel estimates])."""

    num_experts: int
    expert_params: float
    moe_layers: int
    ep_size: int = 1
    topk: int = 1
    capacity_factor: float = 1.0
    min_capacity: int = 4

    @property
    def total_params(self) -> float:
        """Ψ_e: every expert of every MoE layer."""
        return self.num_experts * self.expert_params * self.moe_layers

    def capacity(self, tokens: int) -> int:
        """Slots per expert for ``tokens`` tokens of a rank, as ``experts/gating.py``'s ``capacity_for``."""
        factor = 2 * self.capacity_factor if self.topk == 2 else self.capacity_factor
        return max(math.ceil(tokens / self.num_experts * factor), self.min_capacity)


@dataclass(frozen=True)
class TensorShape:
    """AutoTP: ``size`` T; ``split_params`` X, the parameters split over the T ranks (None: from the
    model's shape, with ``kv_heads`` (default: the heads) and ``ffn`` (default 4 x hidden)); see
    [Note: tensor parallel estimates]."""

    size: int
    split_params: Optional[float] = None
    kv_heads: Optional[int] = None
    ffn: Optional[int] = None
    #: column-parallel layers per transformer layer (q, k, v, gate, up), each an all-reduce in backward
    column_layers: int = 5
    #: row-parallel layers per transformer layer (o, down), each an all-reduce in forward
    row_layers: int = 2

    def split(self, shape: ModelShape) -> Optional[float]:
        """X: as given, else a Llama-style decoder's linear parameters (None without hidden and layers)."""
        if self.split_params is not None:
            return self.split_params
        h, layers = shape.hidden, shape.layers
        if not (h and layers):
            return None
        kv_width = h * self.kv_heads / shape.heads if self.kv_heads and shape.heads else h
        ffn = self.ffn or 4 * h
        return layers * (2 * h * h + 2 * h * kv_width + 3 * h * ffn)


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
    #: micro steps (micro-batches) per optimizer step: the gradient accumulation steps
    micro_steps: int = 1
    #: pipeline parallelism (None: none); the rows are then the first stage's
    pipeline: Optional[PipelineShape] = None
    #: MoE layers (None: a dense model)
    moe: Optional[MoEShape] = None
    #: tensor parallelism (AutoTP; None: none)
    tensor: Optional[TensorShape] = None


def check_parallel(req: EstimateRequest) -> None:
    """Refuse a pipeline or expert-parallel layout that does not fit the ranks, the experts or zeroshard."""
    n, pp = req.world_size, req.pipeline
    if req.tensor is not None:
        check_tensor(req)
    if pp is not None:
        t = tensor_parallel_size(req)
        if pp.stages < 1 or n // t % pp.stages:
            within = f"{n} ranks" if t == 1 else f"{n // t} ranks left by --tp {t}"
            raise EstimateError(f"--pp {pp.stages} does not divide the {within}: the world is pipeline stages x "
                                f"data-parallel ranks, so choose a divisor of {n // t}")
        if req.micro_steps < 1:
            raise EstimateError(f"{req.micro_steps} micro-batches: a pipeline runs at least 1 per step")
        from ..pipeline.schedule import ScheduleShapeError

        schedules = _schedules()
        if pp.schedule not in schedules:
            raise EstimateError(f"schedule {pp.schedule!r}: expected one of {', '.join(schedules)}")
        try:
            schedules[pp.schedule].check(pp.stages, req.micro_steps, pp.chunks)
        except ScheduleShapeError as error:
            raise EstimateError(str(error)) from None
        if req.shape.layers is not None and req.shape.layers < pp.stages:
            raise EstimateError(f"--pp {pp.stages} with {req.shape.layers} layers: every stage needs a layer")
    moe = req.moe
    if moe is None:
        return
    dp = n // pp.stages if pp is not None else n
    if moe.num_experts < 1:
        raise EstimateError(f"--experts {moe.num_experts}: an MoE layer needs at least one expert")
    if moe.topk not in (1, 2):
        raise EstimateError(f"--topk {moe.topk}: zeroshard's MoE routes each token to 1 or 2 experts")
    if moe.ep_size < 1 or moe.num_experts % moe.ep_size:
        raise EstimateError(f"--ep {moe.ep_size} does not divide the {moe.num_experts} experts: each rank of an "
                            f"expert-parallel group holds experts / ep of them")
    if dp % moe.ep_size:
        raise EstimateError(f"--ep {moe.ep_size} does not divide the {dp} data-parallel ranks: choose a divisor "
                            f"of both {dp} and {moe.num_experts}")
    if moe.ep_size > 1 and pp is not None and pp.stages > 1:
        raise EstimateError(f"--ep {moe.ep_size} with --pp {pp.stages}: zeroshard does not run expert "
                            f"parallelism inside a pipeline yet (--ep 1 keeps the experts data parallel)")
    if moe.expert_params < 0 or moe.moe_layers < 0:
        raise EstimateError("--expert-params and --moe-layers cannot be negative")
    if moe.total_params > req.num_params:
        raise EstimateError(f"the experts ({moe.num_experts} x {moe.expert_params:.4g} parameters x "
                            f"{moe.moe_layers} MoE layers = {moe.total_params:.4g}) outnumber the model's "
                            f"{req.num_params:.4g} parameters: --params counts dense and expert parameters")


def check_tensor(req: EstimateRequest) -> None:
    """Refuse a tensor-parallel size that does not divide the ranks or the heads, or a combination
    zeroshard does not train."""
    tp, n = req.tensor, req.world_size
    assert tp is not None
    t = tp.size
    if t < 1 or n % t:
        raise EstimateError(f"--tp {t} does not divide the {n} ranks: the world is tensor-parallel x data-parallel "
                            f"ranks, so choose a divisor of {n}")
    for flag, what, heads in (("--heads", "attention", req.shape.heads), ("--kv-heads", "key/value", tp.kv_heads)):
        if heads is not None and heads % t:
            raise EstimateError(f"--tp {t} does not divide the {heads} {what} heads ({flag}): each rank computes "
                                f"whole heads; choose a divisor of {heads}")
    if t > 1 and req.moe is not None:
        if req.moe.ep_size > 1:
            raise EstimateError(f"--tp {t} with --ep {req.moe.ep_size}: zeroshard does not run tensor parallelism "
                                f"with expert parallelism")
        raise EstimateError(f"--tp {t} with --experts: the estimate does not split MoE layers over tensor-parallel "
                            f"ranks (count the experts in --params and the split part in --tp-params without "
                            f"--experts)")
    x = tp.split(req.shape)
    if x is None:
        raise EstimateError(f"--tp {t} needs the split parameters: --tp-params X, or --hidden and --layers "
                            f"(with --ffn, --heads, --kv-heads) to count a Llama-style decoder's linear layers")
    if not 0 <= x <= req.num_params:
        raise EstimateError(f"{x:.4g} split parameters (--tp-params, or counted from --hidden/--layers/--ffn) but the "
                            f"model has {req.num_params:.4g}: give --tp-params between 0 and --params")


def tensor_rank_params(req: EstimateRequest) -> float:
    """Ψ_rank = X/T + (Ψ - X): a tensor-parallel rank's share of the split parameters and all the rest."""
    assert req.tensor is not None
    x = req.tensor.split(req.shape)
    assert x is not None, "check_parallel refuses --tp without the split parameters"
    return x / req.tensor.size + (req.num_params - x)


def tensor_parallel_size(req: EstimateRequest) -> int:
    """T: 1 without tensor parallelism."""
    return req.tensor.size if req.tensor is not None else 1


def pipeline_stage_count(req: EstimateRequest) -> int:
    """P: 1 without a pipeline."""
    return req.pipeline.stages if req.pipeline is not None else 1


def data_parallel_size(req: EstimateRequest) -> int:
    """The ranks ZeRO shards a rank's model states over: N / (T x P)."""
    return req.world_size // (tensor_parallel_size(req) * pipeline_stage_count(req))


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
    if req.tensor is not None:  # see [Note: tensor parallel estimates]
        t = req.tensor.size
        per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * scale
    else:
        per_layer = s * b * h * (34 + 5 * a * s / h) * scale
    in_flight = req.pipeline.in_flight(req.micro_steps) if req.pipeline is not None else 1
    if req.checkpointing:  # one layer recomputes at a time, whatever the micro-batches in flight
        return in_flight * (2 * s * b * h * scale) * layers + per_layer
    return in_flight * per_layer * layers


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
    return buckets + (prefetch_bytes(req) if stage == 3 else 0.0)


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


def moe_from_hf_config(config: dict) -> Optional[dict]:
    """Experts, parameters per expert, MoE layers and top-k of a Mixtral, Qwen2/3-MoE or OLMoE style
    Hugging Face config (None for a dense one).  An expert is a SwiGLU MLP, 3 x hidden x its
    intermediate size (``moe_intermediate_size``, else ``intermediate_size``); Qwen-MoE's layers are
    those outside ``mlp_only_layers`` at every ``decoder_sparse_step``-th position, the others' every
    layer.  A shared expert (Qwen2-MoE) trains with every token: it counts as dense."""
    experts = config.get("num_local_experts") or config.get("num_experts")
    hidden, layers = config.get("hidden_size"), config.get("num_hidden_layers")
    ffn = config.get("moe_intermediate_size") or config.get("intermediate_size")
    if not (experts and hidden and layers and ffn):
        return None
    step = config.get("decoder_sparse_step") or 1
    dense_only = set(config.get("mlp_only_layers") or ())
    moe_layers = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    return {"num_experts": int(experts), "expert_params": 3 * hidden * ffn, "moe_layers": moe_layers,
            "topk": int(config.get("num_experts_per_tok") or 1)}
