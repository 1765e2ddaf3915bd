"""The table ``zeroshard estimate`` prints: a line on the request, one on each parallel layout in use,
a row per ZeRO stage, the bytes between pipeline stages, experts and tensor-parallel ranks, and the
recommended stage.  The numbers are ``planning/estimator.py``'s.
"""

from __future__ import annotations

from typing import Optional

from .estimate_request import EstimateRequest, data_parallel_size, tensor_rank_params
from .estimator import (GB, StageEstimate, activation_bytes, all_to_all_bytes, compute_bytes, fp8_gather_buffer_bytes,
                        gathered_bytes_per_pass, pipeline_p2p_bytes, recommend, sequence_exchange_bytes, stage_layers,
                        tensor_parallel_bytes)

__all__ = ["format_table"]


def format_table(req: EstimateRequest, estimates: list[StageEstimate], gpu_memory_gb: Optional[float]) -> str:
    precision = "mixed precision (16-bit params/grads, fp32 Adam)" if req.precision == "mixed" else "fp32 (Adam)"
    held_in_fp32 = req.precision == "mixed" and req.grad_bytes == 4
    lines = [f"{req.num_params:.3g} parameters, {req.world_size} ranks, {precision}"
             + (", gradients held in fp32" if held_in_fp32 else "")
             + (f", offload {req.offload}" if req.offload else "")
             + (f", {req.trainable:g} of them trainable (the rest frozen)" if req.trainable < 1 else "")
             + (", flash attention (no s x s scores held)" if req.flash_attention else "")
             + "; per rank, decimal GB",
             *_parallel_header(req),
             "",
             "| stage | params | grads | optimizer | model states | activations | buffers | total | host (offload) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in estimates:
        lines.append(f"| {e.stage} | {e.params / GB:g} | {e.grads / GB:g} | "
                     f"{e.optimizer / GB:g} | "
                     f"{e.model_states / GB:g} | {e.activations / GB:.4g} | {e.buffers / GB:.4g} | "
                     f"{e.total / GB:.4g} | {e.host / GB:g} |")
    lines += _parallel_footer(req)
    if req.fp8:
        dtype, fp8 = gathered_bytes_per_pass(req)
        lines.append(f"fp8: stage 3 gathers FP8 layers' weights at one byte per element: {fp8 / GB:.4g} GB received "
                     f"per rank per pass over the model were every parameter such a weight (heads, embeddings, norms "
                     f"and biases stay in the compute dtype), against {dtype / GB:.4g} GB without FP8; stage 3's "
                     f"buffers include one gather's packed chunks ({fp8_gather_buffer_bytes(req) / GB:.4g} GB); FP8 "
                     f"adds no model state")
    if gpu_memory_gb is not None:
        best = recommend(estimates, gpu_memory_gb)
        lines.append("")
        lines.append(f"recommendation: ZeRO stage {best} is the lowest that fits {gpu_memory_gb:g} GB with 10% headroom"
                     if best is not None else
                     f"recommendation: no stage fits {gpu_memory_gb:g} GB; add ranks, offload, or checkpoint activations")
    return "\n".join(lines)


def _micro_batches(count: float) -> str:
    return f"{count:g} micro-batch" + ("" if count == 1 else "es")


def _parallel_header(req: EstimateRequest) -> list[str]:
    """The table's lines on the pipeline's and the MoE layers' layout (none without them)."""
    lines = []
    pp, moe, m = req.pipeline, req.moe, req.micro_steps
    if pp is not None:
        layers = stage_layers(req)
        held = f" of {layers} layers" if layers else ""
        dp = data_parallel_size(req)
        lines.append(f"pipeline: {pp.stages} stages x {dp} data-parallel ranks, {pp.schedule}, {_micro_batches(m)} "
                     f"per step; a stage holds {req.num_params / pp.stages:.4g} parameters"
                     f"{' (before the tensor split)' if req.tensor is not None else ''}, ZeRO over its {dp} ranks; "
                     f"rows: the first stage, activations of {_micro_batches(pp.in_flight(m))}{held} in flight")
    if moe is not None:
        ranks = req.world_size // (pp.stages if pp is not None else 1)
        lines.append(f"MoE: {moe.moe_layers} layers x {moe.num_experts} experts x {moe.expert_params:.4g} parameters "
                     f"= {moe.total_params:.4g} expert + {req.num_params - moe.total_params:.4g} dense, "
                     f"top-{moe.topk}, ep {moe.ep_size}: a rank holds {moe.num_experts // moe.ep_size} of each layer's "
                     f"{moe.num_experts} experts, their state sharded over the {ranks // moe.ep_size} ranks "
                     f"holding them")
    tp = req.tensor
    if tp is not None:
        x = tp.split(req.shape)
        assert x is not None
        dp = data_parallel_size(req)
        counted = "--tp-params" if tp.split_params is not None else _counted_split(req)
        per_stage = (f", {tensor_rank_params(req) / pp.stages:.4g} of them in a stage of the pipeline"
                     if pp is not None else "")
        lines.append(f"tensor parallel: {tp.size} tensor-parallel x {dp} data-parallel ranks; {x:.4g} of the "
                     f"{req.num_params:.4g} parameters split ({counted}), the rest whole: a rank holds "
                     f"X/T + (Ψ - X) = {tensor_rank_params(req):.4g} parameters{per_stage}, ZeRO over its {dp} "
                     f"data-parallel ranks")
        if activation_bytes(req):
            lines.append(f"activations: s*b*h*(10 + 24/T + 5*a*s/(h*T)) per layer (T = {tp.size}: attention and MLP "
                         f"intermediates split, layer inputs and norms whole)")
    sp = req.sequence
    if sp is not None and sp.size > 1:
        dp = data_parallel_size(req) // sp.size
        per_layer = ("(s/P)*b*h*34 per layer + one ring block's 5*a*(s/P)^2*b" if sp.mode == "ring" else
                     "(s/P)*b*h*(34 + 5*a*s/h) per layer (every position of a/P heads in attention)")
        lines.append(f"sequence parallel ({sp.mode}): {dp} data-parallel x {sp.size} sequence-parallel ranks, each "
                     f"holding seq_len/{sp.size} positions; ZeRO over all {data_parallel_size(req)}; activations: "
                     f"{per_layer}")
    return lines


def _counted_split(req: EstimateRequest) -> str:
    """How the default X was counted, for the table's header."""
    tp, h, heads = req.tensor, req.shape.hidden, req.shape.heads
    assert tp is not None and h is not None
    kv = tp.kv_heads or heads
    attention = "4h^2" if kv is None or kv == heads else f"2h^2 + 2h^2 x {kv}/{heads} kv heads"
    ffn = f"ffn {tp.ffn}" if tp.ffn else f"ffn 4h = {4 * h}"
    return f"{req.shape.layers} layers x ({attention} + 3h x ffn), h {h}, {ffn}: a Llama-style decoder's linear layers"


def _parallel_footer(req: EstimateRequest) -> list[str]:
    """The table's lines on the pipeline bubble and the bytes between stages and between experts."""
    lines = []
    pp, moe, m, dtype = req.pipeline, req.moe, req.micro_steps, compute_bytes(req)
    size = f"{req.micro_batch} x {req.seq_len} x {req.shape.hidden} x {dtype} bytes"
    missing = "give --micro-batch, --seq-len and --hidden for the bytes"
    if pp is not None:
        lines.append("")
        formula = "(P-1)/(m+P-1)" if pp.chunks == 1 else f"(P-1)/({pp.chunks}m+P-1)"
        lines.append(f"pipeline bubble: {formula} = {pp.bubble(m):.1%} of each step idle ({pp.stages} stages, "
                     f"{_micro_batches(m)})")
        p2p = pipeline_p2p_bytes(req)
        boundaries = f"{pp.stages - 1} {'boundary' if pp.stages == 2 else 'boundaries'}"
        lines.append(f"between stages: {p2p / GB:.4g} GB per boundary per step ({_micro_batches(m)} x {size}, forward "
                     f"and as much backward), {boundaries}" if p2p is not None else f"between stages: {missing}")
    if moe is not None:
        lines.append("")
        exchanged = all_to_all_bytes(req)
        if moe.ep_size == 1:
            lines.append("all-to-all: none (--ep 1: every rank holds every expert)")
        elif exchanged is None:
            lines.append(f"all-to-all: {missing}")
        else:
            assert req.micro_batch is not None and req.seq_len is not None
            capacity = moe.capacity(req.micro_batch * req.seq_len)
            lines.append(f"all-to-all: {exchanged / GB:.4g} GB per MoE layer per micro-batch per rank "
                         f"(4 x {moe.ep_size - 1}/{moe.ep_size} x {moe.num_experts} experts x capacity {capacity} x "
                         f"{req.shape.hidden} x {dtype} bytes), {exchanged * moe.moe_layers * m / GB:.4g} GB per rank "
                         f"per step ({moe.moe_layers} layers x {_micro_batches(m)})")
    sp = req.sequence
    if sp is not None and sp.size > 1:
        lines.append("")
        sent = sequence_exchange_bytes(req)
        what = "ring send/recv" if sp.mode == "ring" else "all-to-all"
        if sent is None:
            lines.append(f"sequence {what}: {missing}")
        else:
            layers = req.shape.layers
            per_step = (f", {sent * layers * m / GB:.4g} GB per rank per step ({layers} layers x {_micro_batches(m)})"
                        if layers else ", give --layers for the bytes per step")
            formula = ("(3P-2) x the key/value block b x s/P x 2h_kv" if sp.mode == "ring" else
                       "2 x (P-1)/P x b x s/P x (2h + 2h_kv): query, key, value and context, forward and backward")
            lines.append(f"sequence {what}: {sent / GB:.4g} GB per attention layer per micro-batch per rank "
                         f"({formula}, x {dtype} bytes){per_step}")
    tp = req.tensor
    if tp is not None:
        lines.append("")
        sent = tensor_parallel_bytes(req)
        if tp.size == 1:
            lines.append("tensor-parallel all-reduce: none (--tp 1)")
        elif sent is None:
            lines.append(f"tensor-parallel all-reduce: {missing}")
        else:
            layers = stage_layers(req)  # a pipeline stage's layers
            held = " of a stage" if req.pipeline is not None else ""
            per_step = (f", {sent * layers * m / GB:.4g} GB per rank per step ({layers} layers{held} x "
                        f"{_micro_batches(m)})" if layers else ", give --layers for the bytes per step")
            lines.append(f"tensor-parallel all-reduce: {sent / GB:.4g} GB per layer per micro-batch per rank "
                         f"({tp.row_layers + tp.column_layers} all-reduces, {tp.row_layers} forward + "
                         f"{tp.column_layers} backward, x 2 x {tp.size - 1}/{tp.size} x {size})"
                         f"{per_step}; over DTensor, not in the buffers")
    return lines
