"""What ``zeroshard estimate`` is asked: the model's shape, the parallel layout (``PipelineShape``,
``MoEShape``, ``TensorShape``; ``moe_from_hf_config`` reads the MoE layout from a Hugging Face config), the
``EstimateRequest`` that holds them, the checks that refuse a layout zeroshard cannot train, and the
sizes the layout implies (T, P, the data-parallel ranks, Ψ_rank).

The arithmetic on a request is ``planning/estimator.py``'s (the layouts' formulas: [Note: pipeline and
expert parallel estimates] in planning/estimator.py, [Note: tensor parallel estimates] in
planning/estimator.py); the table ``zeroshard estimate`` prints, ``planning/estimate_report.py``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from .quantised_traffic import Quantisation

__all__ = ["ModelShape", "EstimateError", "PipelineShape", "MoEShape", "moe_from_hf_config", "TensorShape",
           "SequenceShape", "EstimateRequest", "check_parallel", "check_tensor", "check_sequence", "tensor_rank_params",
           "tensor_parallel_size", "pipeline_stage_count", "data_parallel_size"]


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
    engine, which imports the planning package's accounting, and with it this module."""
    from ..pipeline.schedule import SCHEDULES

    return SCHEDULES


@dataclass(frozen=True)
class PipelineShape:
    """Pipeline parallelism: ``stages`` P, ``schedule`` "1f1b", "gpipe" or "interleaved_1f1b" with
    ``chunks`` v per stage (see [Note: pipeline and expert parallel estimates] in planning/estimator.py); the
    micro-batches m of a step are ``EstimateRequest.micro_steps``."""

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
    parallel estimates] in planning/estimator.py)."""

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


@dataclass(frozen=True)
class TensorShape:
    """AutoTP: ``size`` T; ``split_params`` X, the parameters split over the T ranks (None: from the
    model's shape, with ``kv_heads`` (default: the heads) and ``ffn`` (default 4 x hidden)); see
    [Note: tensor parallel estimates] in planning/estimator.py."""

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
class SequenceShape:
    """Sequence parallelism (``sequence_parallel_size`` P, ``sequence_parallel.mode``): each sequence is
    split over P ranks, which ZeRO counts as data-parallel ranks; ``kv_heads`` (None: the heads) sizes
    the keys and values exchanged (see [Note: sequence parallel estimates] in planning/estimator.py)."""

    size: int
    mode: str = "ulysses"  # or "ring"
    kv_heads: Optional[int] = None


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
    #: the fraction of parameters that train (LoRA: ~0.01); the rest are frozen (see estimator.estimate_stage)
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
    #: sequence parallelism (None: none)
    sequence: Optional[SequenceShape] = None
    #: attention that never holds the s x s scores (flash / memory-efficient kernels; [Note: the
    #: activation estimate] in planning/estimator.py)
    flash_attention: bool = False
    #: FP8 linear layers (the ``fp8`` block): stage 3 gathers their weights at one byte per element
    fp8: bool = False
    #: ZeRO++'s qwZ and qgZ (the config's ``zero_quantized_*`` keys): the scale model counts their bytes
    quantisation: Optional[Quantisation] = None


def check_parallel(req: EstimateRequest) -> None:
    """Refuse a pipeline or expert-parallel layout that does not fit the ranks, the experts or zeroshard."""
    n, pp = req.world_size, req.pipeline
    if req.tensor is not None:
        check_tensor(req)
    if req.sequence is not None:
        check_sequence(req)
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


def check_sequence(req: EstimateRequest) -> None:
    """Refuse a sequence-parallel layout zeroshard does not train: a degree that does not divide the
    ranks, the sequence or (Ulysses) the heads, and sequence parallelism beside pipelines, tensor or
    expert parallelism, as training refuses them."""
    sp, n = req.sequence, req.world_size
    assert sp is not None
    p = sp.size
    if sp.mode not in ("ulysses", "ring"):
        raise EstimateError(f"--sp-mode {sp.mode!r}: expected ulysses or ring")
    if p < 1 or n % p:
        raise EstimateError(f"--sp {p} does not divide the {n} ranks: the world is data-parallel x sequence-parallel "
                            f"ranks, so choose a divisor of {n}")
    if p == 1:
        return
    others = [flag for flag, used in (("--pp", req.pipeline is not None and req.pipeline.stages > 1),
                                      ("--tp", req.tensor is not None and req.tensor.size > 1),
                                      ("--ep", req.moe is not None and req.moe.ep_size > 1)) if used]
    if others:
        raise EstimateError(f"--sp {p} with {', '.join(others)}: zeroshard does not run sequence parallelism with "
                            f"pipeline, tensor or expert parallelism")
    if req.seq_len is not None and req.seq_len % p:
        raise EstimateError(f"--sp {p} does not divide --seq-len {req.seq_len}: each rank holds seq_len / sp positions")
    heads, kv = req.shape.heads, sp.kv_heads
    if kv is not None and heads is not None and heads % kv:
        raise EstimateError(f"--kv-heads {kv} does not divide --heads {heads}: query heads share key/value heads "
                            f"in equal groups")
    if sp.mode == "ulysses":
        if heads is not None and heads % p:
            raise EstimateError(f"--sp {p} does not divide the {heads} attention heads: Ulysses hands each rank "
                                f"heads / sp of them (--sp-mode ring takes any head count)")
        if kv is not None and kv % p and p % kv:
            raise EstimateError(f"--sp {p} with {kv} key/value heads: Ulysses splits them (a divisor count) or "
                                f"repeats them (a count dividing --sp); neither fits")


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
