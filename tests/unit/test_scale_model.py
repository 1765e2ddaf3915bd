"""The scale model of `zeroshard estimate`: byte formulas by hand, the overlap windows, memory with MiCS
and hpZ, the recommendation, and the CLI's options and errors."""

import pytest

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
