"""The scale model over three axes: which (tensor, pipeline, data, ZeRO stage) layout trains fastest in
the memory there is.

    zeroshard estimate --params 70e9 --hidden 8192 --layers 80 --heads 64 --kv-heads 8 --ffn 28672 \\
        --nodes 16 --gpus-per-node 8 --intra-node-bw 900GB/s --inter-node-bw 50GB/s --tflops 400 \\
        --seq-len 4096 --micro-batch 1 --gpu-memory 80 --search-parallel

[Note: three parallel axes in the scale model]
A candidate is T tensor-parallel x D data-parallel x P pipeline ranks (T D P = N), numbered as
``ParallelDims`` numbers them (tensor innermost, pipeline outermost: rank = (stage D + data) T + tensor),
with a ZeRO stage over the data axis (MiCS or hpZ too without a pipeline, which refuses them).  Per
rank and optimizer step of m micro-batches:

- ZeRO: :func:`traffic_per_step` over the rank's data-parallel group, D ranks T apart (inside a node
  while T D fits one, else across nodes with G/T of them on each node of G GPUs), for the rank's share
  of the parameters, Ψ_rank/P with Ψ_rank = X/T + (Ψ - X) (``estimator.state_parts``); at stage 3 in a
  pipeline one gather per step, held through the batch (zeroshard's default; [Note: a stage's
  parameters gathered once per batch] in pipeline/engine.py), not two per micro-batch;
- tensor parallel: ``estimator.tensor_parallel_bytes`` per layer and micro-batch (the all-reduces of
  b x s x h activations that torch's DTensor layers issue, forward and backward; see [Note: tensor
  parallel estimates] in planning/estimator.py) x ceil(layers/P) layers x m, over the T consecutive
  ranks of a node;
- pipeline: ``estimator.pipeline_p2p_bytes``, per micro-batch one activation forward and one gradient
  backward across a stage boundary, between ranks T D apart: across nodes once T D is a node or more.
  A rank of an inner stage sends exactly that; at P = 2 a rank sends half of it, but both halves lie
  on the path of every micro-batch, so both are counted;
- compute: 6Ψ/(T P) FLOPs per token (8Ψ/(T P) with activation checkpointing).

The tensor-parallel all-reduces sit between a layer's matmuls and a stage's sends between its compute
and the next stage's, so nothing hides them: they run in ``Phase.CRITICAL_PATH``, added to the micro
steps' time, and ZeRO's collectives still hide only behind compute (conservative: they could also
overlap the tensor-parallel wait).  The bubble: 1F1B and GPipe both take m + P - 1 micro-batch slots
for m micro-batches, so

    step = (compute + exposed communication of the micro steps) x (m + P - 1)/m + the gather after the step

and the bubble, the added part, is (P-1)/(m+P-1) of the pipelined time (``scale_model.bubble_factor``).
Memory is ``estimator.estimate_hybrid`` for the layout: model states of Ψ_rank/P over D, activations of
ceil(layers/P) layers for min(P, m) micro-batches in flight under 1F1B (the first stage's), with the
tensor-parallel per-layer formula.

The search compares layouts at the same work: every layout trains N x b x K sequences per optimizer
step (b: micro batch, K: ``--grad-accum``), so a model replica of T P ranks runs m = K T P
micro-batches of b.  Compute per rank is then the same for every layout, a deeper pipeline gets more
micro-batches (a smaller bubble), and what differs is memory, traffic and the bubble.  Candidates: T
divides a node's GPUs (tensor traffic is the heaviest and stays on NVLink) and the heads, P divides
N/T and is at most the layers; each with stages 0-3, and with MiCS and hpZ over a node's data-parallel
ranks (G/T) and the sizes asked, where they divide D.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from ..distributed.parallel_dims import ParallelDims
from .estimate_request import EstimateError, EstimateRequest, PipelineShape, TensorShape, check_parallel
from .estimator import GB, pipeline_p2p_bytes, stage_layers, tensor_parallel_bytes
from .scale_model import (Cluster, CollectiveTraffic, Phase, ScaleEstimate, Sharding, default_shardings,
                          group_placement, recommend_scale, sharding_estimate)

__all__ = ["layout_request", "tensor_parallel_traffic", "pipeline_traffic", "layout_shardings",
           "layout_estimates", "layout_refusal", "candidate_layouts", "refused_layouts", "search_layouts",
           "best_per_layout", "format_layout_table"]


def layout_request(req: EstimateRequest, dims: ParallelDims, micro_steps: int) -> EstimateRequest:
    """``req`` laid out as ``dims`` with ``micro_steps`` micro-batches per step; the split parameters,
    key/value heads and MLP width of ``req.tensor`` and the schedule and stage-3 gathering of
    ``req.pipeline`` are kept."""
    tensor = req.tensor or TensorShape(dims.tp)
    pipeline = req.pipeline or PipelineShape(dims.pp)
    return dataclasses.replace(req, world_size=dims.world_size, micro_steps=micro_steps,
                               tensor=dataclasses.replace(tensor, size=dims.tp) if dims.tp > 1 else None,
                               pipeline=dataclasses.replace(pipeline, stages=dims.pp) if dims.pp > 1 else None)


def _needs_activation_shape(req: EstimateRequest, what: str) -> None:
    if not (req.micro_batch and req.seq_len and req.shape.hidden):
        raise EstimateError(f"{what} bytes need the micro batch, the sequence length and the hidden size "
                            f"(--micro-batch, --seq-len, --hidden or --hf-config)")


def tensor_parallel_traffic(req: EstimateRequest, dims: ParallelDims, ranks_per_node: int) -> list[CollectiveTraffic]:
    """The tensor-parallel all-reduces of one rank per optimizer step (none without tensor
    parallelism), over its T consecutive ranks (see [Note: three parallel axes in the scale model])."""
    if dims.tp == 1:
        return []
    per_layer = tensor_parallel_bytes(req)
    if per_layer is None:
        _needs_activation_shape(req, "tensor-parallel")
    layers = stage_layers(req)
    if not layers:
        raise EstimateError("tensor-parallel bytes per step need the layers (--layers or --hf-config)")
    assert per_layer is not None and req.tensor is not None
    group = group_placement(dims.groups("tensor"), ranks_per_node)
    calls = (req.tensor.row_layers + req.tensor.column_layers) * layers * req.micro_steps
    return [CollectiveTraffic("tensor_all_reduce", "tensor_all_reduce", Phase.CRITICAL_PATH, calls, group.size,
                              group.crosses_nodes, group.ranks_per_node,
                              round(per_layer * layers * req.micro_steps))]


def pipeline_traffic(req: EstimateRequest, dims: ParallelDims, ranks_per_node: int) -> list[CollectiveTraffic]:
    """The activations and gradients crossing a stage boundary per optimizer step (none without a
    pipeline), between ranks T x D apart (see [Note: three parallel axes in the scale model])."""
    if dims.pp == 1:
        return []
    sent = pipeline_p2p_bytes(req)
    if sent is None:
        _needs_activation_shape(req, "pipeline")
    assert sent is not None
    pairs = [pipeline[s:s + 2] for pipeline in dims.pipelines() for s in range(dims.pp - 1)]
    pair = group_placement(pairs, ranks_per_node)
    return [CollectiveTraffic("pipeline_p2p", "pipeline_p2p", Phase.CRITICAL_PATH, 2 * req.micro_steps, 2,
                              pair.crosses_nodes, pair.ranks_per_node, round(sent))]


def layout_shardings(dims: ParallelDims, gpus_per_node: int, mics_sizes: Sequence[int] = (),
                     hpz_sizes: Sequence[int] = ()) -> list[Sharding]:
    """Stages 0-3, and without a pipeline (zeroshard's pipeline refuses MiCS and hpZ) MiCS and hpZ over
    a node's data-parallel ranks (G/T) and the sizes asked, those that divide D and shard over more
    than one rank and fewer than D."""
    if dims.pp > 1:
        return [Sharding(stage) for stage in range(4)]
    node = max(1, gpus_per_node // dims.tp)
    return [s for s in default_shardings(dims.dp, node, mics_sizes, hpz_sizes)
            if all(size is None or (dims.dp % size == 0 and (size > 1 or size in mics_sizes))
                   for size in (s.mics_shard_size, s.hpz_partition_size))]


def layout_estimates(req: EstimateRequest, cluster: Cluster, dims: ParallelDims, shardings: Sequence[Sharding],
                     micro_steps: int) -> list[ScaleEstimate]:
    """Each sharding's traffic, time and memory with the model laid out as ``dims`` and ``micro_steps``
    micro-batches per step.  Raises EstimateError for a layout the estimate refuses (a size that does
    not divide the heads, more stages than layers) or bytes it cannot count without the shape."""
    laid_out = layout_request(req, dims, micro_steps)
    check_parallel(laid_out)
    per_node = min(cluster.gpus_per_node, dims.world_size)
    model_parallel = (tensor_parallel_traffic(laid_out, dims, per_node)
                      + pipeline_traffic(laid_out, dims, per_node))
    return [sharding_estimate(laid_out, cluster, s, micro_steps, model_parallel) for s in shardings]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _possible_layouts(cluster: Cluster, tp_sizes: Optional[Sequence[int]],
                      pp_sizes: Optional[Sequence[int]]) -> list[ParallelDims]:
    """Every T x D x P = N with T dividing a node's GPUs and P dividing N/T (``tp_sizes`` / ``pp_sizes``
    fix an axis)."""
    n = cluster.world_size
    return [ParallelDims(pp, n // (tp * pp), tp)
            for tp in tp_sizes or [t for t in _divisors(cluster.gpus_per_node) if n % t == 0]
            for pp in pp_sizes or _divisors(n // tp)
            if tp >= 1 and pp >= 1 and n % (tp * pp) == 0]


def layout_refusal(req: EstimateRequest, dims: ParallelDims) -> Optional[str]:
    """Why the estimate refuses ``req`` laid out as ``dims`` (a size that does not divide the heads,
    more stages than layers, more split parameters than the model has); None: it does not."""
    try:
        check_parallel(layout_request(req, dims, req.micro_steps * dims.tp * dims.pp))
    except EstimateError as err:
        return str(err)
    return None


def candidate_layouts(req: EstimateRequest, cluster: Cluster, tp_sizes: Optional[Sequence[int]] = None,
                      pp_sizes: Optional[Sequence[int]] = None) -> list[ParallelDims]:
    """The layouts the search compares: the possible ones the estimate does not refuse."""
    return [d for d in _possible_layouts(cluster, tp_sizes, pp_sizes) if layout_refusal(req, d) is None]


def refused_layouts(req: EstimateRequest, cluster: Cluster, tp_sizes: Optional[Sequence[int]] = None,
                    pp_sizes: Optional[Sequence[int]] = None) -> dict[str, list[ParallelDims]]:
    """The possible layouts the search leaves out, by the estimate's reason."""
    out: dict[str, list[ParallelDims]] = {}
    for dims in _possible_layouts(cluster, tp_sizes, pp_sizes):
        reason = layout_refusal(req, dims)
        if reason is not None:
            out.setdefault(reason, []).append(dims)
    return out


def search_layouts(req: EstimateRequest, cluster: Cluster, micro_steps: int, mics_sizes: Sequence[int] = (),
                   hpz_sizes: Sequence[int] = (), tp_sizes: Optional[Sequence[int]] = None,
                   pp_sizes: Optional[Sequence[int]] = None) -> list[ScaleEstimate]:
    """Every candidate layout with each of its shardings, all at the same global batch: a layout of T x P
    ranks per replica runs ``micro_steps`` x T x P micro-batches (see [Note: three parallel axes in the
    scale model])."""
    out: list[ScaleEstimate] = []
    for dims in candidate_layouts(req, cluster, tp_sizes, pp_sizes):
        shardings = layout_shardings(dims, cluster.gpus_per_node, mics_sizes, hpz_sizes)
        out += layout_estimates(req, cluster, dims, shardings, micro_steps * dims.tp * dims.pp)
    return out


def _layout_of(e: ScaleEstimate) -> ParallelDims:
    assert e.dims is not None, "a layout estimate carries its dims"
    return e.dims


def best_per_layout(estimates: Sequence[ScaleEstimate], gpu_memory_gb: Optional[float]) -> list[ScaleEstimate]:
    """For each layout, in the order first seen, the fastest sharding that fits (``recommend_scale``),
    else the one that needs the least memory."""
    by_layout: dict[ParallelDims, list[ScaleEstimate]] = {}
    for e in estimates:
        by_layout.setdefault(_layout_of(e), []).append(e)
    return [recommend_scale(group, gpu_memory_gb) or min(group, key=lambda e: e.memory.total)
            for group in by_layout.values()]


def format_layout_table(req: EstimateRequest, cluster: Cluster, estimates: Sequence[ScaleEstimate],
                        gpu_memory_gb: Optional[float], micro_steps: int, searched: bool,
                        refused: Optional[dict[str, list[ParallelDims]]] = None) -> str:
    """The layouts' table (one row per layout when ``searched``, its best sharding; else every sharding
    of the one layout), the layouts left out and why (``refused``), and the recommended (tp, pp, dp,
    stage), in markdown."""
    rows = best_per_layout(estimates, gpu_memory_gb) if searched else list(estimates)
    precision = "fp32" if req.precision == "fp32" else "16-bit"
    batch = (f"every layout trains {cluster.world_size} x {req.micro_batch} x {micro_steps} sequences of "
             f"{req.seq_len} tokens per step: a replica of tp x pp ranks runs {micro_steps} x tp x pp micro-batches"
             if searched else f"{micro_steps} micro-batch(es) of {req.micro_batch} x {req.seq_len} tokens per step")
    lines = [f"parallel layouts: {req.num_params:.3g} parameters, {cluster.world_size} ranks ({cluster.nodes} "
             f"node{'s' if cluster.nodes != 1 else ''} x {cluster.gpus_per_node} GPUs), {precision}; {batch}"
             + (", activation checkpointing" if req.checkpointing else ""),
             "ranks: tensor innermost (a node's neighbours), then data, pipeline outermost"
             + ("; each row: the layout's fastest configuration that fits, else its smallest" if searched else ""),
             "",
             "| tp | pp | dp | configuration | micro-batches | compute s | comm s (intra + inter) | exposed s | "
             "bubble s | step s | intra-node GB | inter-node GB | memory GB | fits |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in rows:
        d, t = _layout_of(e), e.time
        fits = "-" if gpu_memory_gb is None else ("yes" if e.fits(gpu_memory_gb) else "no")
        lines.append(f"| {d.tp} | {d.pp} | {d.dp} | {e.sharding.name} | {e.traffic.micro_steps} | {t.compute_s:.3g} | "
                     f"{t.comm_s:.3g} ({t.comm_intra_s:.3g} + {t.comm_inter_s:.3g}) | {t.exposed_s:.3g} | "
                     f"{t.bubble_s:.3g} | {t.step_s:.3g} | {e.traffic.intra_bytes / GB:.4g} | "
                     f"{e.traffic.inter_bytes / GB:.4g} | {e.memory.total / GB:.4g} | {fits} |")
    lines += ["", "GB: bytes one rank sends per optimizer step (ZeRO, tensor-parallel all-reduces, pipeline sends); "
              "exposed: communication nothing hides (the tensor-parallel and pipeline traffic always); bubble: "
              "(P-1)/(m+P-1) of the pipelined step (see [Note: three parallel axes in the scale model] in "
              "zeroshard/planning/parallel_search.py)"]
    for reason, layouts in (refused or {}).items():
        names = ", ".join(f"tp {d.tp} x pp {d.pp}" for d in layouts)
        lines.append(f"left out: {names}: {reason}")
    best = recommend_scale(estimates, gpu_memory_gb)
    if best is None:
        lines.append(f"recommended: nothing fits {gpu_memory_gb:g} GB with 10% headroom; add nodes, offload "
                     f"(--offload)" + ("" if req.checkpointing else " or checkpoint activations (--checkpointing)"))
        return "\n".join(lines)
    d = _layout_of(best)
    which = (f"the fastest that fits {gpu_memory_gb:g} GB with 10% headroom" if gpu_memory_gb is not None
             else "the fastest (memory not checked: give --gpu-memory)")
    bubble = PipelineShape(d.pp).bubble(best.traffic.micro_steps)
    lines.append(f"recommended: tp {d.tp} x pp {d.pp} x dp {d.dp}, {best.sharding.name}, {which} (step "
                 f"{best.time.step_s:.3g} s, bubble {bubble:.1%}, {best.traffic.inter_bytes / GB:.4g} GB across "
                 f"nodes, {best.memory.total / GB:.4g} GB per GPU)")
    return "\n".join(lines)
