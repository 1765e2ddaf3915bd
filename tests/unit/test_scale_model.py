"""The scale model of `zeroshard estimate`: byte formulas by hand, the overlap windows, memory with MiCS
and hpZ, the recommendation, tensor x data x pipeline layouts (placement, bytes, bubble, search), and the
CLI's options and errors."""

import dataclasses

import pytest

from zeroshard.distributed.parallel_dims import ParallelDims
from zeroshard.planning import bubble_factor, layout_estimates, search_layouts
from zeroshard.planning.estimator import ModelShape, PipelineShape, TensorShape
from zeroshard.tools.cli import main
from zeroshard.planning import (Cluster, CollectiveTraffic, EstimateRequest, Phase, ScaleEstimate, Sharding, StepTime,
                              Traffic, default_shardings, estimate_hybrid, hybrid_model_state_bytes, parse_bandwidth,
                              recommend_scale, scale_estimates, secondary_param_bytes, step_time, traffic_per_step)
from zeroshard.planning.estimator import estimate_stage

GB = 1e9


def scopes(traffic: Traffic) -> tuple[int, int]:
    return traffic.intra_bytes, traffic.inter_bytes


# ---------------------------------------------------------------- bytes: N = 4 ranks on 2 nodes of 2, 1000 elements
# A ring over the 4 ranks spans both nodes; p = g = 2 bytes, so B = 2000 full bytes and (N-1)/N B = 1500.

def test_plain_stages_by_hand() -> None:
    assert scopes(traffic_per_step(0, 1000, 4, 2, 1, 2, 2)) == (0, 3000)         # all-reduce 2*3/4*2000
    assert scopes(traffic_per_step(0, 1000, 4, 2, 5, 2, 2)) == (0, 3000)         # once per step, whatever K
    assert scopes(traffic_per_step(1, 1000, 4, 2, 3, 2, 2)) == (0, 1500 + 1500)  # RS at the boundary + AG
    assert scopes(traffic_per_step(2, 1000, 4, 2, 3, 2, 2)) == (0, 3 * 1500 + 1500)  # RS per micro step + AG
    assert scopes(traffic_per_step(3, 1000, 4, 2, 2, 2, 2)) == (0, 3 * 2 * 1500)  # (AG + AG + RS) per micro step
    by_kind = traffic_per_step(3, 1000, 4, 2, 2, 2, 2).by_kind()
    assert by_kind == {"all_gather": 6000, "reduce_scatter": 3000, "all_reduce": 0}


def test_one_node_is_all_intra_node_and_dtypes_are_separate() -> None:
    assert scopes(traffic_per_step(3, 1000, 4, 4, 1, 2, 2)) == (4500, 0)
    assert scopes(traffic_per_step(3, 1000, 4, 8, 1, 2, 2)) == (4500, 0)  # fewer ranks than a node holds
    # fp32 parameters gathered (4 bytes), gradients reduced in bf16 (2 bytes)
    t = traffic_per_step(1, 1000, 4, 2, 1, 4, 2)
    assert t.by_kind() == {"all_gather": 3000, "reduce_scatter": 1500, "all_reduce": 0}
    assert traffic_per_step(0, 1000, 1, 1, 1, 2, 2).inter_bytes == traffic_per_step(0, 1000, 1, 1, 1, 2, 2).intra_bytes == 0


def test_mics_by_hand() -> None:
    # S = 2 = ranks per node: group collectives inside the node, (S-1)/S * 2000 = 1000 each; R = 2 replicas
    # all-reduce a 500-element shard (1000 bytes) across nodes: 2*(R-1)/R*1000 = 1000
    assert scopes(traffic_per_step(3, 1000, 4, 2, 2, 2, 2, mics_shard_size=2)) == (3 * 2 * 1000, 1000)
    assert scopes(traffic_per_step(1, 1000, 4, 2, 3, 2, 2, mics_shard_size=2)) == (1000 + 1000, 1000)
    assert scopes(traffic_per_step(2, 1000, 4, 2, 3, 2, 2, mics_shard_size=2)) == (3 * 1000 + 1000, 1000)
    t = traffic_per_step(3, 1000, 4, 2, 1, 2, 2, mics_shard_size=2)
    assert t.by_kind() == {"all_gather": 2000, "reduce_scatter": 1000, "all_reduce": 1000}
    replicas = next(c for c in t.by_collective if c.name == "grad_replicas")
    assert (replicas.group_size, replicas.crosses_nodes, replicas.ranks_per_node, replicas.phase) == (2, True, 1,
                                                                                                       Phase.BOUNDARY)
    # S = N is plain ZeRO: no replicas; -1 is off, as in the config
    assert traffic_per_step(3, 1000, 4, 2, 1, 2, 2, mics_shard_size=4) == traffic_per_step(3, 1000, 4, 2, 1, 2, 2)
    assert traffic_per_step(3, 1000, 4, 2, 1, 2, 2, mics_shard_size=-1) == traffic_per_step(3, 1000, 4, 2, 1, 2, 2)


def test_hpz_by_hand() -> None:
    # K = 2: one AG over N (1500, across nodes), 2K-1 = 3 AGs over S = 2 (1000 each, inside the node),
    # K = 2 RS over N (1500 each, across nodes)
    t = traffic_per_step(3, 1000, 4, 2, 2, 2, 2, hpz_partition_size=2)
    assert scopes(t) == (3000, 1500 + 3000)
    phases = {c.name: (c.phase, c.calls) for c in t.by_collective}
    assert phases == {"param_gather_first_forward": (Phase.FIRST_FORWARD, 1),
                      "param_gather_forward_hpz": (Phase.LATER_FORWARDS, 1),
                      "param_gather_backward_hpz": (Phase.BACKWARD, 2),
                      "grad_reduce_scatter": (Phase.BACKWARD, 2)}
    assert traffic_per_step(3, 1000, 4, 2, 1, 2, 2, hpz_partition_size=1) == traffic_per_step(3, 1000, 4, 2, 1, 2, 2)


def test_rounding_follows_the_engine_per_call() -> None:
    # N = 6 on 3 nodes of 2, MiCS S = 2, R = 3: a 2-element bucket's shard is 1 element (2 bytes), all-reduced
    # over 3 ranks: 2*2*2 // 3 = 2 per call.  Two such buckets send 4; one 4-element bucket 2*2*4 // 3 = 5.
    def replicas(numel):
        t = traffic_per_step(3, numel, 6, 2, 1, 2, 2, mics_shard_size=2)
        return t.by_kind()["all_reduce"]

    assert replicas([2, 2]) == 4 and replicas(4) == 5
    # buckets padded to a multiple of N: per-bucket and whole counts agree
    assert scopes(traffic_per_step(3, [1000, 1000], 4, 2, 2, 2, 2)) == scopes(traffic_per_step(3, 2000, 4, 2, 2, 2, 2))
    calls = {c.name: c.calls for c in traffic_per_step(3, [1000, 1000], 4, 2, 2, 2, 2).by_collective}
    assert calls == {"param_gather_forward": 4, "param_gather_backward": 4, "grad_reduce_scatter": 4}


def test_units_kept_from_forward_to_backward_are_not_gathered_again() -> None:
    """``stage3_max_reuse_distance``: a bucket (backward's order) is kept while twice the elements of the
    buckets before it are under the limit; kept, its backward gather (or hpZ's) does not run."""
    def calls(reuse: int | None, **knobs: int) -> dict[str, int]:
        traffic = traffic_per_step(3, [1000, 1000, 1000], 4, 2, 2, 2, 2, max_reuse_distance=reuse, **knobs)
        return {c.name: c.calls for c in traffic.by_collective}
    assert calls(None) == calls(0) == {"param_gather_forward": 6, "param_gather_backward": 6, "grad_reduce_scatter": 6}
    assert calls(2500) == {"param_gather_forward": 6, "param_gather_backward": 2, "grad_reduce_scatter": 6}
    assert calls(10**9) == {"param_gather_forward": 6, "grad_reduce_scatter": 6}  # the default keeps all three
    hpz = calls(10**9, hpz_partition_size=2)
    assert "param_gather_backward_hpz" not in hpz and hpz["param_gather_forward_hpz"] == 3


def test_groups_that_straddle_nodes_count_across_nodes() -> None:
    # 6 ranks on 2 nodes of 3: shard groups {0,1} {2,3} {4,5}; {2,3} spans nodes, so the reported rank does too
    t = traffic_per_step(3, 600, 6, 3, 1, 2, 2, mics_shard_size=2)
    group = next(c for c in t.by_collective if c.name == "param_gather_forward")
    assert group.crosses_nodes and group.ranks_per_node == 1


def test_refuses_what_the_engine_refuses() -> None:
    with pytest.raises(ValueError, match="does not divide|divides"):
        traffic_per_step(3, 1200, 4, 2, 1, 2, 2, mics_shard_size=3)
    with pytest.raises(ValueError, match="hpZ needs stage 3"):
        traffic_per_step(2, 1000, 4, 2, 1, 2, 2, hpz_partition_size=2)
    with pytest.raises(ValueError, match="MiCS needs stage 1-3"):
        traffic_per_step(0, 1000, 4, 2, 1, 2, 2, mics_shard_size=2)
    with pytest.raises(ValueError, match="together"):
        traffic_per_step(3, 1000, 4, 2, 1, 2, 2, mics_shard_size=2, hpz_partition_size=2)
    with pytest.raises(ValueError, match="padded"):
        traffic_per_step(3, 1001, 4, 2, 1, 2, 2, mics_shard_size=2)


def test_published_volume_ratios() -> None:
    """ZeRO: stage 3 moves 1.5x data parallelism's bytes, stages 1-2 1x.  ZeRO++: hpZ cuts ZeRO-3's
    cross-node 3M to 2M per step; with K micro steps to (K+1)/(3K)."""
    n, per_node, numel = 1024, 8, 1024 * 10 ** 6
    ddp = traffic_per_step(0, numel, n, per_node, 1, 2, 2).inter_bytes
    assert traffic_per_step(3, numel, n, per_node, 1, 2, 2).inter_bytes == 1.5 * ddp
    assert traffic_per_step(1, numel, n, per_node, 1, 2, 2).inter_bytes == ddp
    assert traffic_per_step(2, numel, n, per_node, 1, 2, 2).inter_bytes == ddp
    for k in (1, 4):
        zero3 = traffic_per_step(3, numel, n, per_node, k, 2, 2).inter_bytes
        hpz = traffic_per_step(3, numel, n, per_node, k, 2, 2, hpz_partition_size=per_node).inter_bytes
        assert hpz / zero3 == pytest.approx((k + 1) / (3 * k))


# ---------------------------------------------------------------- time

def one(phase: Phase, seconds: float, crosses: bool = False, m: int = 1) -> CollectiveTraffic:
    # with 1 byte/s links, bytes_sent is seconds (intra) or seconds * m (across nodes at m ranks per node)
    return CollectiveTraffic("x", "all_gather", phase, 1, 2, crosses, m, int(seconds * (m if crosses else 1)))


SLOW = Cluster(nodes=2, gpus_per_node=2, intra_node_bw=1.0, inter_node_bw=1.0, tflops=1.0)


def test_boundary_communication_hides_only_behind_the_last_backward() -> None:
    t = step_time(Traffic(4, (one(Phase.BOUNDARY, 3),)), SLOW, forward_s=1.0, backward_s=2.0)
    assert t.compute_s == 12 and t.exposed_s == 1 and t.step_s == 13 and t.hidden_s == 2


def test_per_micro_step_communication_and_the_step_after() -> None:
    # 8 s of backward gathers over K = 4 micro steps: 2 s per backward of 2 s, all hidden
    t = step_time(Traffic(4, (one(Phase.BACKWARD, 8),)), SLOW, 1.0, 2.0)
    assert t.exposed_s == 0 and t.step_s == 12
    # forward gathers of 8 s: 2 s per forward of 1 s: 1 s exposed per micro step
    assert step_time(Traffic(4, (one(Phase.FORWARD, 8),)), SLOW, 1.0, 2.0).exposed_s == 4
    # after the step nothing overlaps
    assert step_time(Traffic(4, (one(Phase.AFTER_STEP, 1),)), SLOW, 1.0, 2.0).exposed_s == 1
    # hpZ: the first forward's 3 s gather is exposed 2 s; the later forwards' 0.5 s each hide
    t = step_time(Traffic(4, (one(Phase.FIRST_FORWARD, 3), one(Phase.LATER_FORWARDS, 1.5))), SLOW, 1.0, 2.0)
    assert t.exposed_s == 2


def test_a_ring_across_nodes_uses_one_nic_per_rank_of_the_node() -> None:
    cluster = Cluster(2, 8, intra_node_bw=300.0, inter_node_bw=50.0, tflops=1.0)
    world = CollectiveTraffic("w", "all_gather", Phase.FORWARD, 1, 16, True, 8, 800)
    replicas = CollectiveTraffic("r", "all_reduce", Phase.BOUNDARY, 1, 2, True, 1, 800)
    inside = CollectiveTraffic("i", "all_gather", Phase.FORWARD, 1, 8, False, 8, 900)
    assert cluster.seconds(world) == 800 / 300  # 8 x 50 = 400, capped by the NVLink hops at 300
    assert cluster.seconds(replicas) == 800 / 50
    assert cluster.seconds(inside) == 3


def test_compute_follows_six_flops_per_parameter_and_token() -> None:
    req = EstimateRequest(1e9, 16, micro_batch=2, seq_len=1000)
    cluster = Cluster(2, 8, 1e15, 1e15, tflops=100.0)
    (e,) = scale_estimates(req, cluster, [Sharding(0)], micro_steps=3)
    assert e.time.compute_s == pytest.approx(3 * 6 * 1e9 * 2000 / 100e12)
    ckpt = EstimateRequest(1e9, 16, micro_batch=2, seq_len=1000, checkpointing=True)
    (c,) = scale_estimates(ckpt, cluster, [Sharding(0)], micro_steps=3)
    assert c.time.compute_s == pytest.approx(e.time.compute_s * 8 / 6)
    with pytest.raises(ValueError, match="micro_batch and seq_len"):
        scale_estimates(EstimateRequest(1e9, 16), cluster, [Sharding(0)])


# ---------------------------------------------------------------- memory

def test_hybrid_memory() -> None:
    psi = 7e9
    req = EstimateRequest(psi, 16)
    mics = estimate_hybrid(req, 3, mics_shard_size=8)
    assert mics.model_states == 16 * psi / 8 == estimate_stage(EstimateRequest(psi, 8), 3).model_states
    assert estimate_hybrid(req, 1, mics_shard_size=8).model_states == 4 * psi + 12 * psi / 8
    hpz = estimate_hybrid(req, 3, hpz_partition_size=8)
    assert hpz.secondary_params == 2 * psi / 8 and hpz.total == estimate_stage(req, 3).total + 2 * psi / 8
    assert estimate_hybrid(req, 2) == estimate_stage(req, 2)
    assert secondary_param_bytes(psi, 8, "fp32") == 4 * psi / 8 and secondary_param_bytes(psi, 1) == 0
    states = hybrid_model_state_bytes(3, psi, 16, "mixed", hpz_partition_size=8)
    assert states.secondary_params == psi / 4 and states.total == 16 * psi / 16 + psi / 4
    assert hybrid_model_state_bytes(3, psi, 16, "mixed", mics_shard_size=8).total == 16 * psi / 8


# ---------------------------------------------------------------- recommendation

def fake(name: int, step: float, memory_gb: float, inter: int) -> ScaleEstimate:
    traffic = Traffic(1, (CollectiveTraffic("x", "all_gather", Phase.FORWARD, 1, 2, True, 1, inter),))
    memory = estimate_stage(EstimateRequest(memory_gb * GB / 16, 1), 0)  # 16 bytes per parameter
    return ScaleEstimate(Sharding(name), traffic, StepTime(step, 0.0, 0.0, 0.0), memory)


def test_recommends_the_fastest_that_fits() -> None:
    a, b, c = fake(0, 1.0, 100, 10), fake(1, 2.0, 60, 10), fake(2, 3.0, 20, 10)
    assert recommend_scale([a, b, c], 80) is b       # a does not fit 80 GB with 10% headroom
    assert recommend_scale([a, b, c], 120) is a
    assert recommend_scale([a, b, c], None) is a
    assert recommend_scale([a, b, c], 10) is None
    assert recommend_scale([fake(3, 1.0, 72, 10)], 80) is not None  # 72 <= 0.9 * 80
    # within 1% the one that sends less across nodes wins
    fast, lean = fake(0, 1.0, 10, 1000), fake(1, 1.005, 10, 10)
    assert recommend_scale([fast, lean], 80) is lean
    assert recommend_scale([fast, fake(1, 1.02, 10, 10)], 80) is fast


def test_default_shardings() -> None:
    names = [s.name for s in default_shardings(16, 8, mics_sizes=[4, 8], hpz_sizes=[16])]
    assert names == ["stage 0", "stage 1", "stage 2", "stage 3", "MiCS S=8, stage 1", "MiCS S=8, stage 2",
                     "MiCS S=8, stage 3", "MiCS S=4, stage 1", "MiCS S=4, stage 2", "MiCS S=4, stage 3",
                     "hpZ S=8 (stage 3)"]
    assert len(default_shardings(8, 8)) == 4  # one node: hybrid is plain ZeRO


def test_parse_bandwidth() -> None:
    assert parse_bandwidth("900GB/s") == 900e9
    assert parse_bandwidth("50 GB/s") == 50e9
    assert parse_bandwidth("400Gbps") == parse_bandwidth("400Gb/s") == 50e9
    assert parse_bandwidth("1.6Tbps") == 200e9
    assert parse_bandwidth("1GiB/s") == 2 ** 30
    for bad in ("50", "fast", "-5GB/s", "0GB/s", "50 GHz"):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)


# ---------------------------------------------------------------- CLI

SCALE = ["estimate", "--params", "70e9", "--nodes", "128", "--gpus-per-node", "8", "--intra-node-bw", "900GB/s",
         "--inter-node-bw", "400Gbps", "--tflops", "400", "--seq-len", "4096", "--micro-batch", "1"]


def test_cli_scale_table(capsys) -> None:
    assert main(SCALE + ["--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "1024 ranks (128 nodes x 8 GPUs)" in out and "50 GB/s per GPU across nodes" in out
    rows = [line for line in out.splitlines() if line.startswith("| ")][2:]
    assert [r.split(" | ")[0][2:] for r in rows] == [
        "stage 0", "stage 1", "stage 2", "stage 3", "MiCS S=8, stage 1", "MiCS S=8, stage 2", "MiCS S=8, stage 3",
        "hpZ S=8 (stage 3)"]
    # stage 3: 3 x 1023/1024 x 140 GB across nodes, at 8 x 50 GB/s: 1.05 s, hidden behind 4.3 s of compute
    assert "| stage 3 | 4.3 | 1.05 (0 + 1.05) | 1.05 | 0 | 4.3 | 0 | 419.6 |" in out
    # 70B does not fit 80 GB with MiCS over one node (142 GB of states); hpZ and stage 3 tie at 4.3 s, and
    # hpZ sends a third less across nodes
    assert "| MiCS S=8, stage 3 |" in out and "142.1 | no |" in out
    assert "recommendation: hpZ S=8 (stage 3), the fastest that fits 80 GB" in out
    assert main(SCALE + ["--grad-accum", "4", "--mics-shard-size", "16", "--hpz-partition-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "4 micro step(s)" in out and "MiCS S=16, stage 3" in out and "hpZ S=16 (stage 3)" in out
    assert "memory not checked" in out


def test_cli_without_the_scale_options_prints_the_memory_table(capsys) -> None:
    assert main(["estimate", "--params", "7e9", "--gpus-per-node", "8", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "| 1 | 14 | 14 | 10.5 | 38.5 |" in out and "scale model" not in out


@pytest.mark.parametrize("extra, message", [
    (["--tflops", "400"], "missing --intra-node-bw, --inter-node-bw"),
    (["--mics-shard-size", "8"], "--mics-shard-size belong"),
])
def test_cli_refuses_a_half_given_scale_model(extra, message) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["estimate", "--params", "7e9", "--gpus-per-node", "8", "--seq-len", "8", "--micro-batch", "1"] + extra)


@pytest.mark.parametrize("change, message", [
    (["--inter-node-bw", "50"], "--inter-node-bw '50' is not a bandwidth"),
    (["--intra-node-bw", "0GB/s"], "--intra-node-bw '0GB/s'"),
    (["--tflops", "0"], "--tflops 0"),
    (["--mics-shard-size", "3"], r"--mics-shard-size 3 does not divide the 1024 ranks \(--nodes 128 x "
                                 r"--gpus-per-node 8\): choose a divisor of 1024"),
    (["--hpz-partition-size", "1"], "--hpz-partition-size 1 does not divide"),
    (["--grad-accum", "0"], "--grad-accum 0"),
])
def test_cli_errors_name_the_option_and_the_fix(change, message) -> None:
    argv = list(SCALE)
    flag = change[0]
    if flag in argv:
        argv[argv.index(flag) + 1] = change[1]
    else:
        argv += change
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_cli_scale_model_needs_tokens() -> None:
    argv = [a for a in SCALE if a not in ("--seq-len", "4096")]
    with pytest.raises(SystemExit, match="--micro-batch and --seq-len"):
        main(argv)


def test_cli_on_one_node_lists_only_plain_stages(capsys) -> None:
    assert main(["estimate", "--params", "7e9", "--gpus-per-node", "8", "--intra-node-bw", "900GB/s",
                 "--inter-node-bw", "50GB/s", "--tflops", "400", "--seq-len", "4096", "--micro-batch", "1",
                 "--hidden", "4096", "--layers", "32", "--heads", "32", "--checkpointing", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "MiCS" not in out.split("\n\n")[1] and "one node" in out and "+ activations" in out
    assert "| stage 0 |" in out and "116.3 | no |" in out


# ---------------------------------------------------------------- tensor x data x pipeline layouts
# 8 ranks as tp 2 x dp 2 x pp 2, numbered (stage*dp + data)*tp + tensor: stage 0 is ranks 0-3, stage 1 ranks
# 4-7; tensor groups {0,1} {2,3} ..., data-parallel groups {0,2} {1,3} {4,6} {5,7}, stage pairs (0,4) (1,5) ...



def test_data_parallel_groups_sit_where_parallel_dims_puts_them() -> None:
    # dp 2, T = 2 apart: inside a node of 4, across nodes of 2 (one rank of the group on each)
    assert scopes(traffic_per_step(3, 1000, 2, 4, 1, 2, 2, tensor_parallel=2, pipeline_stages=2)) == (3000, 0)
    t = traffic_per_step(3, 1000, 2, 2, 1, 2, 2, tensor_parallel=2, pipeline_stages=2)
    assert scopes(t) == (0, 3000) and {(c.group_size, c.ranks_per_node) for c in t.by_collective} == {(2, 1)}
    # dp 4 x tp 2 on 2 nodes of 4: {0,2,4,6} spans both nodes with 2 on each
    wide = traffic_per_step(3, 1000, 4, 4, 1, 2, 2, tensor_parallel=2)
    assert scopes(wide) == (0, 4500) and {c.ranks_per_node for c in wide.by_collective} == {2}
    # MiCS S = 2 over dp 4 x tp 2 on nodes of 4: shard groups {0,2} {4,6} inside a node, replicas {0,4} across
    mics = traffic_per_step(3, 1000, 4, 4, 1, 2, 2, mics_shard_size=2, tensor_parallel=2)
    assert scopes(mics) == (3 * 1000, 1000)
    # tp = pp = 1 is the data-parallel model, to the byte
    assert traffic_per_step(3, 1000, 4, 2, 2, 2, 2, tensor_parallel=1, pipeline_stages=1) == \
        traffic_per_step(3, 1000, 4, 2, 2, 2, 2)


def small_model(world: int, micro_steps: int = 3) -> EstimateRequest:
    """Ψ = 10000, X = 6000 split; b 2 x s 8 x h 8 activations, 4 layers; 16-bit."""
    return EstimateRequest(10000, world, micro_batch=2, seq_len=8, micro_steps=micro_steps,
                           shape=ModelShape(hidden=8, layers=4, heads=2), tensor=TensorShape(1, split_params=6000))


def test_tp2_pp2_dp2_bytes_by_hand() -> None:
    """Per rank, m = 3 micro-batches, stage 3:
    ZeRO: Ψ_rank = (6000/2 + 4000)/2 = 3500 over dp 2, 1/2 x 3500 x 2 = 3500 bytes per collective: one
    gather per step (the pipeline holds the stage's parameters through the batch) and 3 reduce-scatters
    (10500); gathering per micro-batch, 3 forward and 3 backward gathers (10500 each);
    tensor: 7 all-reduces x 2 x 1/2 x (2 x 8 x 8 x 2 = 256) = 1792 per layer, x 2 layers x 3 = 10752;
    pipeline: (activation + gradient) x 3 x 256 = 1536."""
    def bytes_by_name(nodes: int, per_node: int, per_micro_batch: bool = False) -> dict[str, tuple[int, bool]]:
        cluster = Cluster(nodes, per_node, 1e9, 1e9, 1.0)
        model = dataclasses.replace(small_model(8), pipeline=PipelineShape(2, gather_per_micro_batch=per_micro_batch))
        (e,) = layout_estimates(model, cluster, ParallelDims(2, 2, 2), [Sharding(3)], 3)
        return {c.name: (c.bytes_sent, c.crosses_nodes) for c in e.traffic.by_collective}

    # 2 nodes of 4: a stage per node: ZeRO and tensor inside, only the pipeline across
    assert bytes_by_name(2, 4) == {"param_gather_per_step": (3500, False), "grad_reduce_scatter": (10500, False),
                                   "tensor_all_reduce": (10752, False), "pipeline_p2p": (1536, True)}
    # 4 nodes of 2: a node holds one tensor group, so ZeRO crosses nodes as well
    assert bytes_by_name(4, 2) == {"param_gather_per_step": (3500, True), "grad_reduce_scatter": (10500, True),
                                   "tensor_all_reduce": (10752, False), "pipeline_p2p": (1536, True)}
    assert bytes_by_name(2, 4, per_micro_batch=True) == {
        "param_gather_forward": (10500, False), "param_gather_backward": (10500, False),
        "grad_reduce_scatter": (10500, False), "tensor_all_reduce": (10752, False), "pipeline_p2p": (1536, True)}
    # 1 node of 8: nothing crosses
    cluster = Cluster(1, 8, 1e9, 1e9, 1.0)
    (e,) = layout_estimates(small_model(8), cluster, ParallelDims(2, 2, 2), [Sharding(3)], 3)
    assert scopes(e.traffic) == (3500 + 10500 + 10752 + 1536, 0)
    assert e.traffic.by_kind() == {"all_gather": 3500, "reduce_scatter": 10500, "all_reduce": 0,
                                   "tensor_all_reduce": 10752, "pipeline_p2p": 1536}
    # memory: the estimator's, for the rank's 3500 parameters over 2, and the stage's 3500 held gathered
    assert e.memory.model_states == 16 * 3500 / 2 and (e.dims.tp, e.dims.pp, e.dims.dp) == (2, 2, 2)
    assert e.memory.buffers == 2 * 3500 * 2 + 3500 * 2  # two gradient buckets of the rank's share + the held stage


def test_tensor_and_pipeline_traffic_is_on_the_critical_path() -> None:
    # 1 byte/s inside the node: 31500 s of ZeRO hides behind nothing (compute ~0), tensor and pipeline add theirs
    cluster = Cluster(1, 8, 1.0, 1.0, 1e12)
    (e,) = layout_estimates(small_model(8), cluster, ParallelDims(2, 2, 2), [Sharding(3)], 3)
    assert e.time.comm_s == pytest.approx(3500 + 10500 + 10752 + 1536)
    assert e.time.exposed_s == pytest.approx(e.time.comm_s, rel=1e-6)
    # compute per rank: 6 Ψ / (T P) per token, 3 micro-batches of 16 tokens
    fast = Cluster(1, 8, 1e15, 1e15, 1.0)
    (f,) = layout_estimates(small_model(8), fast, ParallelDims(2, 2, 2), [Sharding(0)], 3)
    assert f.time.compute_s == pytest.approx(3 * 6 * 10000 / 4 * 16 / 1e12)


@pytest.mark.parametrize("p, m", [(2, 1), (2, 3), (4, 4), (4, 8), (8, 5)])
def test_the_bubble_is_p_minus_one_over_m_plus_p_minus_one(p, m) -> None:
    assert bubble_factor(m, p) == (m + p - 1) / m
    assert PipelineShape(p).bubble(m) == pytest.approx((p - 1) / (m + p - 1))
    # stage 0 has no gather after the step: the whole step is pipelined
    model = dataclasses.replace(small_model(8 * p, m), shape=ModelShape(hidden=8, layers=8, heads=2))
    (e,) = layout_estimates(model, Cluster(p, 8, 1e9, 1e8, 1.0), ParallelDims(p, 8, 1), [Sharding(0)], m)
    assert e.time.bubble_s / e.time.step_s == pytest.approx((p - 1) / (m + p - 1))
    # by hand: 1 s forward, 2 s backward, 2 s on the critical path, 4 micro steps, P = 3: 14 s x 6/4
    t = step_time(Traffic(4, (one(Phase.CRITICAL_PATH, 2),)), SLOW, 1.0, 2.0, pipeline_stages=3)
    assert (t.compute_s, t.exposed_s, t.bubble_s, t.step_s) == (12, 2, 7, 21)
    # the gather after the step runs once the pipeline has drained: not stretched
    t = step_time(Traffic(4, (one(Phase.CRITICAL_PATH, 2), one(Phase.AFTER_STEP, 1))), SLOW, 1.0, 2.0, 3)
    assert (t.bubble_s, t.step_s) == (7, 22)


def test_one_tensor_and_one_stage_is_the_data_parallel_model() -> None:
    req = EstimateRequest(7e9, 16, micro_batch=1, seq_len=4096, shape=ModelShape(hidden=4096, layers=32, heads=32),
                          checkpointing=True)
    cluster = Cluster(2, 8, 900e9, 50e9, 400.0)
    shardings = default_shardings(16, 8)
    plain = scale_estimates(req, cluster, shardings, 2)
    laid_out = layout_estimates(req, cluster, ParallelDims(1, 16, 1), shardings, 2)
    assert laid_out == plain
    with pytest.raises(ValueError, match="layout_estimates"):
        scale_estimates(dataclasses.replace(req, pipeline=PipelineShape(2)), cluster, shardings)


def seven_b(world: int) -> EstimateRequest:
    """A Llama-2-7B-like model, 4096 tokens, no activation checkpointing: 104 GB of activations at tp 1."""
    return EstimateRequest(6.7e9, world, micro_batch=1, seq_len=4096,
                           shape=ModelShape(hidden=4096, layers=32, heads=32), tensor=TensorShape(1, ffn=11008))


def test_a_model_that_does_not_fit_data_parallel_gets_a_layout_that_does() -> None:
    cluster = Cluster(2, 8, 900e9, 50e9, 400.0)
    estimates = search_layouts(seven_b(16), cluster, micro_steps=1)
    data_parallel = [e for e in estimates if (e.dims.tp, e.dims.pp) == (1, 1)]
    assert data_parallel and not any(e.fits(80) for e in data_parallel)
    best = recommend_scale(estimates, 80)
    assert best is not None and best.fits(80) and best.dims.tp > 1
    # the same global batch everywhere: a replica of tp x pp ranks runs K x tp x pp micro-batches, so compute
    # per rank is the same whatever the layout
    assert {(e.dims.tp * e.dims.pp, e.traffic.micro_steps) for e in estimates} >= {(1, 1), (2, 2), (8, 8)}
    assert len({round(e.time.compute_s, 9) for e in estimates}) == 1
    assert {(d.tp, d.pp) for d in (e.dims for e in estimates)} >= {(1, 1), (2, 1), (8, 2), (1, 16)}


SEARCH = ["estimate", "--params", "6.7e9", "--hidden", "4096", "--layers", "32", "--heads", "32", "--ffn", "11008",
          "--nodes", "2", "--gpus-per-node", "8", "--intra-node-bw", "900GB/s", "--inter-node-bw", "50GB/s",
          "--tflops", "400", "--seq-len", "4096", "--micro-batch", "1", "--gpu-memory", "80"]


def without(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value."""
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


def layout_rows(out: str) -> list[list[str]]:
    """The cells of the layout table's rows."""
    lines = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    return [[cell.strip() for cell in line.strip("| ").split(" | ")] for line in lines]


def test_cli_searches_the_layouts_and_recommends_one(capsys) -> None:
    assert main(without(SEARCH, "--ffn")) == 0  # without --search-parallel: the data-parallel table, as before
    out = capsys.readouterr().out
    assert "parallel layouts" not in out and "recommendation: nothing fits 80 GB" in out
    assert main(SEARCH + ["--search-parallel"]) == 0
    out = capsys.readouterr().out
    assert "| tp | pp | dp | configuration | micro-batches |" in out
    assert "every layout trains 16 x 1 x 1 sequences of 4096 tokens per step" in out
    rows = layout_rows(out)
    assert rows[0][:3] == ["1", "1", "16"] and rows[0][-1] == "no"  # 104 GB of activations
    assert {(r[0], r[1]) for r in rows} >= {("2", "1"), ("8", "2"), ("1", "16")}
    assert "recommended: tp 2 x pp 1 x dp 8, MiCS S=4, stage 3, the fastest that fits 80 GB" in out
    # --pp fixes the axis; --tp 2 --pp 2 without --search-parallel: that layout's shardings
    assert main(SEARCH + ["--search-parallel", "--pp", "2"]) == 0
    assert {r[1] for r in layout_rows(capsys.readouterr().out)} == {"2"}
    assert main(SEARCH + ["--tp", "2", "--pp", "2", "--grad-accum", "4"]) == 0
    out = capsys.readouterr().out
    assert "4 micro-batch(es) of 1 x 4096 tokens per step" in out
    assert "| 2 | 2 | 4 | stage 0 | 4 |" in out and "| 2 | 2 | 4 | stage 3 | 4 |" in out
    assert "recommended: tp 2 x pp 2 x dp 4" in out and "bubble 20.0%" in out
    assert "note:" not in out  # zeroshard trains every layout it recommends


def test_cli_search_says_which_layouts_it_leaves_out_and_what_it_needs(capsys) -> None:
    argv = without(SEARCH, "--ffn") + ["--search-parallel"]
    assert main(argv) == 0  # the default ffn of 4h counts more split parameters than a 6.7e9 model has
    out = capsys.readouterr().out
    assert "left out: tp 2 x pp 1, tp 2 x pp 2" in out and "split parameters" in out
    with pytest.raises(SystemExit, match="--search-parallel needs the model's shape"):
        main(without(argv, "--hidden"))
    with pytest.raises(SystemExit, match="--search-parallel belong"):
        main(["estimate", "--params", "7e9", "--gpus-per-node", "8", "--search-parallel"])
