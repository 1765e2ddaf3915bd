"""The scale model of ``zeroshard estimate``: time, traffic and memory of one optimizer step at scale.

    zeroshard estimate --params 70e9 --nodes 128 --gpus-per-node 8 --intra-node-bw 900GB/s \\
        --inter-node-bw 50GB/s --tflops 400 --seq-len 4096 --micro-batch 1 --gpu-memory 80

For ZeRO stages 0-3 and the hybrid settings MiCS (``mics_shard_size``) and hpZ
(``zero_hpz_partition_size``) it predicts, per rank and per optimizer step, the bytes sent inside a
node and across nodes (:func:`traffic_per_step`, the same byte model as the engine's counters), the
compute time, the communication time, how much of it hides behind compute (:func:`step_time`), the
memory (``estimator.estimate_hybrid``), and recommends the fastest configuration that fits.  Over
tensor x data x pipeline layouts (``--tp``, ``--pp``, ``--search-parallel``) the same model runs per
layout in ``planning/parallel_search.py``, which adds the tensor-parallel and pipeline traffic and
the bubble (:func:`step_time`'s ``pipeline_stages``).

[Note: what the scale model counts]
Traffic is :func:`traffic_per_step`: per optimizer step of K micro steps, Ψ elements, parameter
all-gathers in the compute dtype (p bytes) and gradient collectives in the communication dtype (g):

- stage 0: one all-reduce of the gradients at the boundary, 2(N-1)/N Ψg;
- stage 1: a reduce-scatter at the boundary, (N-1)/N Ψg, and the all-gather of the updated
  parameters after the step, (N-1)/N Ψp; stage 2 reduce-scatters every micro step: K(N-1)/N Ψg;
- stage 3: per micro step a forward all-gather, a backward all-gather (none for a unit kept gathered
  from forward to backward: [Note: units kept from forward to backward] in planning/gather_reuse.py)
  and a reduce-scatter; inside a pipeline (by default) one all-gather per step before the first pass,
  held through the batch, and the K reduce-scatters;
- MiCS S: the stage's collectives over the S ranks of a shard group, plus one all-reduce of each
  rank's gradient shard (Ψ/S elements) across the R = N/S groups at the boundary;
- hpZ S (stage 3): the first forward gathers over all N ranks, the other 2K-1 gathers of the step
  over the S ranks of the secondary partition, the K reduce-scatters over all N.

Ring algorithm: a rank sends (G-1)/G B for an all-gather or reduce-scatter of B full bytes over a
group of G ranks, 2(G-1)/G B for an all-reduce, rounded down per call as ``Collectives._account``
does.  A group inside one node counts as intra-node, a group spanning nodes wholly as inter-node.
Groups are blocks of consecutive data-parallel ranks (torchrun puts a node's ranks next to each
other); with tensor and pipeline parallelism the data-parallel ranks are T apart in every stage, as
``ParallelDims`` numbers them (``group_placement`` is told every group's global ranks), so a group
of D stays in a node while T D ranks fit one.  When the groups do not follow node boundaries, the
rank whose group spans nodes is the one reported (the others wait for it).

[Note: link speeds]
``intra_node_bw`` is what one GPU sends per second to its node's other GPUs (one direction, what
nccl-tests reports as bus bandwidth: NVLink's "900 GB/s" is both directions, about 450 GB/s one way);
``inter_node_bw`` is the network bandwidth *per GPU* (a node's NIC bandwidth over its GPUs: 50 GB/s
for one 400 Gb/s NIC per GPU).  A collective inside a node runs at ``intra_node_bw``.  A ring that
spans nodes crosses each node boundary once per ring, and NCCL drives one ring per NIC, so a group
with m ranks on each node moves its per-rank volume at ``min(m * inter_node_bw, intra_node_bw)``:
a whole-world ring (m = GPUs per node) uses all of a node's NICs for one rank's volume, while
MiCS's replica groups (one rank per node, m = 1) each get one NIC, and a node's n ranks send n of
them side by side.  Equivalently, what limits a step is the bytes a *node* pushes into the network:
ZeRO-3 3Ψp per micro step, MiCS 2Ψg per optimizer step (one replica all-reduced).  Latency (the
alpha term, ~G link hops per ring) is left out: the model is a bandwidth model, a lower bound for
small buckets on thousands of ranks, where NCCL switches to trees.

[Note: overlap]
Compute is 6Ψ FLOPs per token (forward 2, backward 4) plus 2Ψ with activation checkpointing (the
recomputed forward runs in backward), at the achieved ``tflops`` per GPU.  Communication can only
hide behind compute that runs *at the same time and does not need its result*, so the step is split
into windows and each window takes ``max(its compute, its communication)``:

- the forward of each micro step hides the forward all-gathers (stage 3, MiCS, hpZ: prefetched
  unit by unit; hpZ's first forward gathers over all ranks, the later ones inside the group);
- the backward of each micro step hides the backward all-gathers and the bucketed reduce-scatters
  of stages 2-3 (issued as buckets fill); the backward of the *last* micro step also hides the
  boundary reductions: stage 0's bucketed all-reduce, stage 1's bucketed reduce-scatter, and MiCS's
  replica all-reduce (launched bucket by bucket as each shard is reduced);
- the all-gather of updated parameters after the step (stages 1-2, MiCS 1-2) is exposed: it
  overlaps only the optimizer's own update, which the FLOP count leaves out (a short, memory-bound
  kernel), and the next forward needs every parameter.

Step time = sum over windows of max(compute, comm) = compute + exposed communication; *hidden* is
the rest of the communication.  Collectives in one window run one after another (zeroshard issues
them in order; intra- and inter-node collectives could overlap each other, which makes this
conservative where both are large).  Two things make the model optimistic: the first gather of a
forward and the last reduce-scatter of a backward have no compute to hide behind (one bucket each,
small for large models), and real overlap is imperfect (compute kernels slow down while NCCL runs).
Everything else (attention FLOPs beyond 6Ψ, optimizer time, offload traffic over PCIe) is out of
the model: pass the *achieved* model TFLOPS (MFU x peak) so that compute time stays honest.

[Note: validation against published figures]
Volumes, exactly: the ZeRO paper's stage 3 moves 1.5x the communication of data parallelism: here
3(N-1)/N Ψ against 2(N-1)/N Ψ at K = 1 (``test_scale_model.py`` checks it); stages 1-2 move 1x. ZeRO++
(blog and paper, arXiv 2306.10209) gives ZeRO-3's cross-node volume as 3M per step (forward gather,
backward gather, reduce-scatter: M each) and hpZ's as 2M (the backward gather stays in the node):
``traffic_per_step`` gives 3(N-1)/N M and 2(N-1)/N M at K = 1 (with K micro steps: (K+1)/(3K)).

Times, approximately: the model's predictions for ZeRO++'s published runs (384 V100s at 100-800 Gb/s
per node) and MiCS's weak scaling, beside the published figures, are in benchmarks/RESULTS.md, section
"The scale model against published figures".  They show where to trust it: where communication bounds
the step, the prediction follows the published speedups; where communication and compute take about
as long, real overlap is far from perfect, so read the step time as lying between ``step s`` and
``compute s + comm s`` (the no-overlap bound).  A MiCS rank's per-micro-step traffic does not depend on
the number of nodes, and the replica all-reduce (2(R-1)/R of a shard, at most 2x from R = 2 to any R)
hides behind the last backward, so the predicted weak scaling is perfect while that all-reduce fits
there (the table in docs/MULTI_NODE.md: MiCS step times equal from 16 to 512 GPUs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Sequence, Union

from ..distributed.parallel_dims import ParallelDims
from .estimate_request import EstimateRequest, data_parallel_size, pipeline_stage_count, tensor_parallel_size
from .estimator import GB, StageEstimate, estimate_hybrid, state_parts
from .bandwidth import parse_bandwidth  # noqa: F401  (the scale model's command-line units, also its name here)
from .quantised_traffic import Quantisation
from .gather_reuse import kept_through_backward

__all__ = ["Phase", "CollectiveTraffic", "Traffic", "group_placement", "traffic_per_step", "Sharding", "Cluster",
           "StepTime", "ScaleEstimate", "compute_seconds", "bubble_factor", "step_time", "default_shardings",
           "scale_estimates", "sharding_estimate", "recommend_scale", "format_scale_table", "parse_bandwidth"]


class Phase(str, Enum):
    """When in an optimizer step a collective runs, which decides what it can hide behind ([Note: overlap])."""

    FORWARD = "forward"                # in the forward of every micro step
    FIRST_FORWARD = "first_forward"    # in the forward of the first micro step only
    LATER_FORWARDS = "later_forwards"  # in the forwards of micro steps 2..K
    BACKWARD = "backward"              # in the backward of every micro step
    BOUNDARY = "boundary"              # in the backward of the last micro step (the accumulation boundary)
    AFTER_STEP = "after_step"          # after the optimizer step, before the next forward: exposed
    #: in every micro step, between computations that wait for it: tensor-parallel all-reduces and the
    #: pipeline's sends (see [Note: three parallel axes in the scale model] in planning/parallel_search.py)
    CRITICAL_PATH = "critical_path"


@dataclass(frozen=True)
class CollectiveTraffic:
    """One collective of a step: what it is, over which group, and what this rank sends, all calls summed."""

    name: str              # e.g. "param_gather_forward", "grad_reduce_scatter", "grad_replicas"
    kind: str              # the engine's CommKind value: "all_gather", "reduce_scatter" or "all_reduce";
                           # outside the engine "tensor_all_reduce" (DTensor) or "pipeline_p2p"
    phase: Phase
    calls: int             # per optimizer step (per bucket when numel is given by bucket)
    group_size: int
    crosses_nodes: bool
    ranks_per_node: int    # m: the group's ranks on each node it spans (its size inside one node)
    bytes_sent: int        # per rank, per optimizer step


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends in one optimizer step (see [Note: what the scale model counts])."""

    micro_steps: int
    by_collective: tuple[CollectiveTraffic, ...]

    @property
    def intra_bytes(self) -> int:
        """Bytes sent by collectives whose group lies inside one node."""
        return sum(c.bytes_sent for c in self.by_collective if not c.crosses_nodes)

    @property
    def inter_bytes(self) -> int:
        """Bytes sent by collectives whose group spans nodes."""
        return sum(c.bytes_sent for c in self.by_collective if c.crosses_nodes)

    def by_kind(self) -> dict[str, int]:
        """Bytes sent per kind, keyed like the engine's ``CommLedger.counters`` (``CommKind`` values);
        the tensor-parallel and pipeline traffic, which bypasses the engine's collectives, under kinds
        of its own when there is any."""
        out = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}
        for c in self.by_collective:
            out[c.kind] = out.get(c.kind, 0) + c.bytes_sent
        return out

    def by_scope(self) -> dict[str, int]:
        """Bytes sent per scope, keyed like ``Collectives.bytes_sent_by_scope()``."""
        return {"inside_node": self.intra_bytes, "across_nodes": self.inter_bytes}


@dataclass(frozen=True)
class _Group:
    size: int
    crosses_nodes: bool
    ranks_per_node: int


def group_placement(members: Sequence[Sequence[int]], ranks_per_node: int) -> _Group:
    """The reported group among ``members`` (global ranks; see [Note: what the scale model counts]): one
    that spans nodes if any does, with the fewest ranks on a node among those (the slowest ring)."""
    size = len(members[0])
    crossing = []
    for ranks in members:
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[r // ranks_per_node] = per_node.get(r // ranks_per_node, 0) + 1
        if len(per_node) > 1:
            crossing.append(min(per_node.values()))
    if not crossing:
        return _Group(size, False, size)
    return _Group(size, True, min(crossing))


@dataclass(frozen=True)
class _ZeroGroups:
    """Where a rank's ZeRO collectives run: the data-parallel group, the MiCS shard group (the
    data-parallel group without MiCS), the hpZ partition and the MiCS replica group (None when off)."""

    data: _Group
    shard: _Group
    secondary: Optional[_Group]
    replicas: Optional[_Group]


def _zero_groups(dims: ParallelDims, ranks_per_node: int, mics: Optional[int], hpz: Optional[int]) -> _ZeroGroups:
    """Each group's placement, from the job's axes with MiCS's replicas and hpZ's partition (the rank
    lists of [Note: the order of the axes] in distributed/parallel_dims.py)."""
    axes = dataclasses.replace(dims, dp_replicate=dims.dp // mics if mics is not None else 1, hpz=hpz or 1)

    def placed(kind: str) -> _Group:
        return group_placement(axes.groups(kind), ranks_per_node)

    data = placed("zero")
    return _ZeroGroups(data, placed("shard") if mics is not None else data,
                       placed("secondary") if hpz is not None else None,
                       placed("replicate") if mics is not None and mics < dims.dp else None)


def _sent(kind: str, group: int, full_bytes: int) -> int:
    """What one rank sends in one call (the engine's ``Collectives._account``)."""
    factor = 2 if kind == "all_reduce" else 1
    return factor * (group - 1) * full_bytes // group


def _check(stage: int, dims: ParallelDims, ranks_per_node: int, micro_steps: int, mics: Optional[int],
           hpz: Optional[int]) -> None:
    world_size = dims.dp
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage {stage}: 0, 1, 2 or 3")
    if world_size < 1 or ranks_per_node < 1 or micro_steps < 1:
        raise ValueError("world_size, ranks_per_node and micro_steps must be at least 1")
    ranks = dims.world_size
    if ranks % ranks_per_node and ranks > ranks_per_node:
        raise ValueError(f"world_size {ranks} is not a whole number of nodes of {ranks_per_node} ranks")
    if mics is not None and hpz is not None:
        raise ValueError("mics_shard_size and hpz_partition_size together: the engine uses MiCS alone; give one")
    if mics is not None:
        if stage == 0 or mics < 1 or world_size % mics:
            raise ValueError(f"mics_shard_size {mics}: MiCS needs stage 1-3 and a size >= 1 that divides the "
                             f"world size {world_size}")
    if hpz is not None and (stage != 3 or hpz < 2 or world_size % hpz):
        raise ValueError(f"hpz_partition_size {hpz}: hpZ needs stage 3 and a size >= 2 that divides the world "
                         f"size {world_size}")


def _bucket_traffic(stage: int, numel: int, groups: _ZeroGroups, k: int, p: int, g: int,
                    mics: Optional[int], hpz: Optional[int], gather_once: bool,
                    quant: Optional[Quantisation] = None, kept: bool = False) -> list[CollectiveTraffic]:
    """The collectives of one bucket of ``numel`` elements (see [Note: what the scale model counts];
    ``quant``: [Note: quantised bytes in the scale model] in planning/quantised_traffic.py; ``kept``: stage
    3 keeps it gathered from forward to backward)."""
    world, shard = groups.data, groups.shard
    out: list[CollectiveTraffic] = []

    def add(name: str, kind: str, phase: Phase, calls: int, group: _Group, full_bytes: int) -> None:
        if calls:
            out.append(CollectiveTraffic(name, kind, phase, calls, group.size, group.crosses_nodes,
                                         group.ranks_per_node, calls * _sent(kind, group.size, full_bytes)))

    def reduce(phase: Phase, calls: int, group: _Group) -> None:  # a reduce-scatter, or qgZ's two hops
        if quant is None or quant.gradient_bits is None:
            add("grad_reduce_scatter", "reduce_scatter", phase, calls, group, grads)
            return
        local = group.ranks_per_node if group.crosses_nodes else group.size
        nodes = group.size // local
        inside, across = quant.hop_full_bytes(numel, local, nodes)
        if local > 1:
            add("grad_qgz_inside", "all_to_all", phase, calls, _Group(local, False, local), inside)
        if nodes > 1:
            add("grad_qgz_across", "all_to_all", phase, calls, _Group(nodes, True, 1), across)

    params, grads = numel * p, numel * g
    qwz = quant is not None and quant.weights
    if stage == 0:
        add("grad_all_reduce", "all_reduce", Phase.BOUNDARY, 1, world, grads)
    elif stage in (1, 2):
        reduce(Phase.BOUNDARY if stage == 1 else Phase.BACKWARD, 1 if stage == 1 else k, shard)
        add("param_gather_after_step", "all_gather", Phase.AFTER_STEP, 1, shard, params)
    elif hpz is not None:
        assert groups.secondary is not None
        first = quant.gather_full_bytes(numel, world.size) if quant is not None and qwz else params
        add("param_gather_first_forward", "all_gather", Phase.FIRST_FORWARD, 1, world, first)
        add("param_gather_forward_hpz", "all_gather", Phase.LATER_FORWARDS, k - 1, groups.secondary, params)
        add("param_gather_backward_hpz", "all_gather", Phase.BACKWARD, 0 if kept else k, groups.secondary, params)
        reduce(Phase.BACKWARD, k, world)
    elif gather_once:
        add("param_gather_per_step", "all_gather", Phase.AFTER_STEP, 1, shard, params)
        reduce(Phase.BACKWARD, k, shard)
    else:
        gathered = quant.gather_full_bytes(numel, shard.size) if quant is not None and qwz else params
        add("param_gather_forward", "all_gather", Phase.FORWARD, k, shard, gathered)
        add("param_gather_backward", "all_gather", Phase.BACKWARD, 0 if kept else k, shard, gathered)
        reduce(Phase.BACKWARD, k, shard)
    if mics is not None and groups.replicas is not None:
        if numel % mics:
            raise ValueError(f"numel {numel} is not a multiple of mics_shard_size {mics}: pass the padded count "
                             f"(the engine pads each bucket to a multiple of the shard size)")
        add("grad_replicas", "all_reduce", Phase.BOUNDARY, 1, groups.replicas, numel // mics * g)
    return out


def traffic_per_step(stage: int, numel: Union[int, Sequence[int]], world_size: int, ranks_per_node: int,
                     micro_steps: int, param_bytes: int, grad_bytes: int, mics_shard_size: Optional[int] = None,
                     hpz_partition_size: Optional[int] = None, tensor_parallel: int = 1,
                     pipeline_stages: int = 1, gather_once_per_step: bool = False,
                     quantisation: Optional[Quantisation] = None,
                     max_reuse_distance: Optional[int] = None) -> Traffic:
    """Bytes one rank sends in one optimizer step for ZeRO (see [Note: what the scale model counts]).

    ``world_size`` is the number of ranks ZeRO shards over: the data-parallel size, which is the whole
    world without ``tensor_parallel`` and ``pipeline_stages``; with them the world is their product and
    the data-parallel groups sit where ``ParallelDims`` numbers them, so they stay inside a node or
    not as they really do.  ``numel`` is the exact element count of the rank's share the collectives
    move (the engine's padded count: a multiple of ``mics_shard_size`` with MiCS, of ``world_size``
    otherwise; nothing is padded here), or one count per bucket: each collective is then rounded per
    call, as the engine's counters are.  ``param_bytes`` is the compute dtype's element size (parameter
    gathers), ``grad_bytes`` the communication dtype's (gradient reductions).  ``mics_shard_size`` None
    or -1 and ``hpz_partition_size`` None or 1 are off, as in the config.  ``gather_once_per_step``
    (stage 3 inside a pipeline, zeroshard's default): each unit is gathered once before the batch's
    first pass and held, one exposed all-gather instead of two per micro step.  ``quantisation``: ZeRO++'s
    qwZ and qgZ ([Note: quantised bytes in the scale model] in planning/quantised_traffic.py).
    ``max_reuse_distance``: stage 3's ``stage3_max_reuse_distance``, which keeps units gathered from
    forward to backward (None: no unit is kept; [Note: units kept from forward to backward] in
    planning/gather_reuse.py).  Raises ValueError for a size that does not divide ``world_size``.
    """
    mics = mics_shard_size if mics_shard_size is not None and mics_shard_size > 0 else None
    hpz = hpz_partition_size if hpz_partition_size is not None and hpz_partition_size > 1 else None
    if world_size < 1 or tensor_parallel < 1 or pipeline_stages < 1:
        raise ValueError("world_size, tensor_parallel and pipeline_stages must be at least 1")
    dims = ParallelDims(pipeline_stages, world_size, tensor_parallel)
    _check(stage, dims, ranks_per_node, micro_steps, mics, hpz)
    groups = _zero_groups(dims, min(ranks_per_node, dims.world_size), mics, hpz)
    buckets = [numel] if isinstance(numel, int) else list(numel)
    merged: dict[str, CollectiveTraffic] = {}
    for bucket, kept in zip(buckets, kept_through_backward(buckets, max_reuse_distance)):
        for c in _bucket_traffic(stage, int(bucket), groups, micro_steps, param_bytes, grad_bytes, mics, hpz,
                                 gather_once_per_step, quantisation, kept):
            seen = merged.get(c.name)
            merged[c.name] = c if seen is None else dataclasses.replace(
                seen, calls=seen.calls + c.calls, bytes_sent=seen.bytes_sent + c.bytes_sent)
    return Traffic(micro_steps, tuple(merged.values()))


@dataclass(frozen=True)
class Sharding:
    """One configuration the scale model compares: a ZeRO stage, optionally with MiCS or hpZ."""

    stage: int
    mics_shard_size: Optional[int] = None
    hpz_partition_size: Optional[int] = None

    @property
    def name(self) -> str:
        if self.mics_shard_size is not None:
            return f"MiCS S={self.mics_shard_size}, stage {self.stage}"
        if self.hpz_partition_size is not None:
            return f"hpZ S={self.hpz_partition_size} (stage 3)"
        return f"stage {self.stage}"

    @property
    def padding_multiple(self) -> Optional[int]:
        """The group size the engine pads buckets to (None: the world size)."""
        return self.mics_shard_size


@dataclass(frozen=True)
class Cluster:
    """The machines: their layout, link speeds (bytes/s, see [Note: link speeds]) and achieved compute."""

    nodes: int
    gpus_per_node: int
    intra_node_bw: float  # bytes/s one GPU sends inside its node (one direction)
    inter_node_bw: float  # bytes/s of network per GPU (the node's NICs over its GPUs)
    tflops: float         # achieved model TFLOPS per GPU (6Ψ per token)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def seconds(self, c: CollectiveTraffic) -> float:
        """How long ``c`` takes: at the node's link speed, or a spanning ring's (see [Note: link speeds])."""
        if not c.crosses_nodes:
            return c.bytes_sent / self.intra_node_bw
        return c.bytes_sent / min(c.ranks_per_node * self.inter_node_bw, self.intra_node_bw)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step (see [Note: overlap])."""

    compute_s: float
    comm_intra_s: float
    comm_inter_s: float
    exposed_s: float  # communication nothing overlaps
    #: the pipeline's fill and drain: (P-1)/(m+P-1) of the step (0 without a pipeline)
    bubble_s: float = 0.0

    @property
    def comm_s(self) -> float:
        return self.comm_intra_s + self.comm_inter_s

    @property
    def hidden_s(self) -> float:
        return self.comm_s - self.exposed_s

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s + self.bubble_s


def compute_seconds(num_params: float, tokens_per_micro_step: float, tflops: float,
                    checkpointing: bool = False) -> tuple[float, float]:
    """Forward and backward seconds of one micro step: 2Ψ and 4Ψ FLOPs per token (+2Ψ recomputation
    in backward with activation checkpointing) at ``tflops`` achieved per GPU."""
    per_flop = 1.0 / (tflops * 1e12)
    forward = 2 * num_params * tokens_per_micro_step * per_flop
    backward = (4 + (2 if checkpointing else 0)) * num_params * tokens_per_micro_step * per_flop
    return forward, backward


def bubble_factor(micro_steps: int, pipeline_stages: int) -> float:
    """(m + P - 1)/m: how much longer m micro-batches take through P stages than through one, under
    1F1B as under GPipe (the fill and the drain take P - 1 micro-batch slots)."""
    return (micro_steps + pipeline_stages - 1) / micro_steps


def step_time(traffic: Traffic, cluster: Cluster, forward_s: float, backward_s: float,
              pipeline_stages: int = 1) -> StepTime:
    """Compute plus what communication cannot hide, window by window (see [Note: overlap]), the
    micro steps stretched by the pipeline's bubble (:func:`bubble_factor`); the gather after the
    optimizer step runs once the pipeline has drained, outside the bubble."""
    k = traffic.micro_steps
    t = {phase: 0.0 for phase in Phase}
    for c in traffic.by_collective:
        t[c.phase] += cluster.seconds(c)
    later = t[Phase.LATER_FORWARDS] / (k - 1) if k > 1 else 0.0
    windows = [  # (compute, communication, how many such windows in a step)
        (forward_s, t[Phase.FORWARD] / k + t[Phase.FIRST_FORWARD], 1),
        (forward_s, t[Phase.FORWARD] / k + later, k - 1),
        (backward_s, t[Phase.BACKWARD] / k, k - 1),
        (backward_s, t[Phase.BACKWARD] / k + t[Phase.BOUNDARY], 1),
    ]
    compute = sum(n * c for c, _, n in windows)
    exposed_in_micro_steps = sum(n * max(0.0, comm - c) for c, comm, n in windows) + t[Phase.CRITICAL_PATH]
    exposed = exposed_in_micro_steps + t[Phase.AFTER_STEP]
    bubble = (compute + exposed_in_micro_steps) * (bubble_factor(k, pipeline_stages) - 1)
    intra = sum(cluster.seconds(c) for c in traffic.by_collective if not c.crosses_nodes)
    inter = sum(cluster.seconds(c) for c in traffic.by_collective if c.crosses_nodes)
    return StepTime(compute, intra, inter, exposed, bubble)


@dataclass(frozen=True)
class ScaleEstimate:
    """One configuration's traffic, time and memory per rank."""

    sharding: Sharding
    traffic: Traffic
    time: StepTime
    memory: StageEstimate
    #: the tensor, data and pipeline axes (None: data parallel over the whole world)
    dims: Optional[ParallelDims] = None

    def fits(self, gpu_memory_gb: float, headroom: float = 0.1) -> bool:
        return self.memory.total <= gpu_memory_gb * GB * (1 - headroom)


def default_shardings(world_size: int, gpus_per_node: int, mics_sizes: Sequence[int] = (),
                      hpz_sizes: Sequence[int] = ()) -> list[Sharding]:
    """Stages 0-3, then MiCS at stages 1-3 and hpZ for a group of one node and for each size asked.

    A size equal to the world size is plain ZeRO and is left out (so is everything hybrid on one node).
    """
    out = [Sharding(stage) for stage in range(4)]
    for size in dict.fromkeys([gpus_per_node, *mics_sizes]):
        if size < world_size:
            out += [Sharding(stage, mics_shard_size=size) for stage in (1, 2, 3)]
    for size in dict.fromkeys([gpus_per_node, *hpz_sizes]):
        if 1 < size < world_size:
            out.append(Sharding(3, hpz_partition_size=size))
    return out


def scale_estimates(req: EstimateRequest, cluster: Cluster, shardings: Sequence[Sharding],
                    micro_steps: int = 1) -> list[ScaleEstimate]:
    """Traffic, time and memory of each configuration for ``req``'s model on ``cluster``, data parallel
    over the whole world (tensor and pipeline layouts: ``planning/parallel_search.py``).

    ``req`` needs ``micro_batch`` and ``seq_len`` (tokens per micro step).  Gathers and reductions are
    in the training dtype (2 bytes under bf16/fp16, 4 in fp32; zeroshard's default
    ``communication_data_type``), and the element count is padded as the engine pads it.
    """
    if req.tensor is not None or req.pipeline is not None:
        raise ValueError("scale_estimates models data parallelism; for tensor or pipeline parallelism use "
                         "planning.parallel_search.layout_estimates")
    return [sharding_estimate(req, cluster, s, micro_steps) for s in shardings]


def sharding_estimate(req: EstimateRequest, cluster: Cluster, sharding: Sharding, micro_steps: int,
                      model_parallel: Sequence[CollectiveTraffic] = ()) -> ScaleEstimate:
    """One configuration's traffic, time and memory for ``req`` on ``cluster``, laid out over the tensor
    and pipeline axes ``req`` names (``req.tensor``, ``req.pipeline``): ZeRO over the data-parallel
    ranks for the rank's share of the parameters, compute for Ψ/(T x P), and ``model_parallel``, the
    tensor-parallel and pipeline traffic on the critical path, added to the step's collectives."""
    if not (req.micro_batch and req.seq_len):
        raise ValueError("the scale model needs micro_batch and seq_len (tokens per micro step)")
    if req.world_size != cluster.world_size:
        raise ValueError(f"req.world_size {req.world_size} != cluster's {cluster.world_size} ranks")
    tp, pp, dp = tensor_parallel_size(req), pipeline_stage_count(req), data_parallel_size(req)
    elem = 4 if req.precision == "fp32" else 2
    multiple = sharding.padding_multiple or dp
    numel = math.ceil(sum(psi for psi, _ in state_parts(req)) / multiple) * multiple
    held = req.pipeline is not None and req.pipeline.holds_gathered_parameters(sharding.stage)
    # the engine refuses qgZ beside MiCS; inside a pipeline ZeRO++'s bytes are not modelled (a stage's
    # data-parallel group is cut into nodes by the job's rank order, which this model does not follow)
    quant = req.quantisation
    if quant is not None and (sharding.mics_shard_size is not None or pp > 1):
        quant = dataclasses.replace(quant, gradient_bits=None, weights=quant.weights and pp == 1)
    zero = traffic_per_step(sharding.stage, numel, dp, cluster.gpus_per_node, micro_steps, elem, elem,
                            sharding.mics_shard_size, sharding.hpz_partition_size, tp, pp, held, quant)
    traffic = Traffic(micro_steps, zero.by_collective + tuple(model_parallel))
    forward, backward = compute_seconds(req.num_params / (tp * pp), req.micro_batch * req.seq_len, cluster.tflops,
                                        req.checkpointing)
    memory = estimate_hybrid(req, sharding.stage, sharding.mics_shard_size, sharding.hpz_partition_size)
    return ScaleEstimate(sharding, traffic, step_time(traffic, cluster, forward, backward, pp), memory,
                         ParallelDims(pp, dp, tp))


def recommend_scale(estimates: Sequence[ScaleEstimate], gpu_memory_gb: Optional[float], headroom: float = 0.1,
                    tie: float = 0.01) -> Optional[ScaleEstimate]:
    """The fastest configuration that fits ``gpu_memory_gb`` with ``headroom`` (any, without a limit).

    Step times within ``tie`` (1%) of the fastest count as equal, far finer than the model resolves;
    among those the one that sends fewest bytes across nodes wins, then fewest inside a node, then the
    smallest: traffic that is not sent cannot meet a slow link or a busy network.  None: nothing fits.
    """
    fitting = [e for e in estimates if gpu_memory_gb is None or e.fits(gpu_memory_gb, headroom)]
    if not fitting:
        return None
    fastest = min(e.time.step_s for e in fitting)
    near = [e for e in fitting if e.time.step_s <= fastest * (1 + tie)]
    return min(near, key=lambda e: (e.traffic.inter_bytes, e.traffic.intra_bytes, e.memory.total))


def _gbps(bw: float) -> str:
    return f"{bw / GB:g} GB/s"


def format_scale_table(req: EstimateRequest, cluster: Cluster, estimates: Sequence[ScaleEstimate],
                       gpu_memory_gb: Optional[float], micro_steps: int = 1) -> str:
    """The scale model's table and recommendation, in markdown."""
    precision = "fp32" if req.precision == "fp32" else "16-bit"
    lines = [f"scale model: {req.num_params:.3g} parameters, {cluster.world_size} ranks ({cluster.nodes} node{'s' if cluster.nodes != 1 else ''} x "
             f"{cluster.gpus_per_node} GPUs), {precision} gathers and reductions"
             + (f" ({req.quantisation.describe()} where they apply)" if req.quantisation is not None else "")
             + f"; per optimizer step of "
             f"{micro_steps} micro step(s) x {req.micro_batch} x {req.seq_len} tokens per rank"
             + (", activation checkpointing" if req.checkpointing else ""),
             f"links: {_gbps(cluster.intra_node_bw)} per GPU inside a node, {_gbps(cluster.inter_node_bw)} per GPU "
             f"across nodes; {cluster.tflops:g} achieved TFLOPS per GPU",
             "",
             "| configuration | compute s | comm s (intra + inter) | hidden s | exposed s | step s | "
             "intra-node GB | inter-node GB | memory GB | fits |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in estimates:
        t = e.time
        fits = "-" if gpu_memory_gb is None else ("yes" if e.fits(gpu_memory_gb) else "no")
        lines.append(f"| {e.sharding.name} | {t.compute_s:.3g} | {t.comm_s:.3g} ({t.comm_intra_s:.3g} + "
                     f"{t.comm_inter_s:.3g}) | {t.hidden_s:.3g} | {t.exposed_s:.3g} | {t.step_s:.3g} | "
                     f"{e.traffic.intra_bytes / GB:.4g} | {e.traffic.inter_bytes / GB:.4g} | "
                     f"{e.memory.total / GB:.4g} | {fits} |")
    activations = any(e.memory.activations for e in estimates)
    lines += ["", "GB: bytes one rank sends per optimizer step; memory: per rank, model states + buffers"
              + (" + activations" if activations else " (no activations: give --hf-config or --hidden/--layers/"
                 "--heads)") + ".",
              "step s assumes perfect overlap; with none it is compute s + comm s: a real step lies between "
              "(see [Note: overlap] in zeroshard/planning/scale_model.py)"]
    best = recommend_scale(estimates, gpu_memory_gb)
    if best is None:
        lines.append(f"recommendation: nothing fits {gpu_memory_gb:g} GB with 10% headroom; add nodes, offload "
                     f"(--offload)" + ("" if req.checkpointing else " or checkpoint activations (--checkpointing)"))
        return "\n".join(lines)
    which = (f"the fastest that fits {gpu_memory_gb:g} GB with 10% headroom" if gpu_memory_gb is not None
             else "the fastest (memory not checked: give --gpu-memory)")
    lines.append(f"recommendation: {best.sharding.name}, {which} (step {best.time.step_s:.3g} s, "
                 f"{best.traffic.inter_bytes / GB:.4g} GB across nodes, {best.memory.total / GB:.4g} GB per GPU)")
    return "\n".join(lines)
