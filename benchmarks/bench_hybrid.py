"""Hybrid sharding and ZeRO++ against full sharding on two "nodes": bytes across nodes, step time and memory.

    .venv/bin/python benchmarks/bench_hybrid.py [--inter-node-mbit 500] [--steps 10] [--size 5m]
        [--configs s3 s3-mics2 s3-hpz2 s2 s2-mics2] [--out benchmarks/out/hybrid.json]
    .venv/bin/python benchmarks/bench_hybrid.py --size 91m --steps 5 --configs bf16-s3 bf16-s3-hpz2 bf16-zeropp

Two ``zeroshard run`` agents (torchrun, c10d rendezvous), two processes each: world 4 as two nodes of
two.  As root, each agent runs in a network namespace of its own and the two are joined by a veth
pair whose egress is limited with ``tc`` (token bucket) to ``--inter-node-mbit``: traffic between
the ranks of one node stays on that namespace's loopback (unlimited), traffic between nodes crosses
the slow link, as on a cluster whose network is much slower than its intra-node links.  Without
namespaces (not root, no ``ip``/``tc``, or ``--loopback``) both agents share the loopback: the byte
counts are the same, the times say nothing about a slow network.

Configurations (``--configs``, by key; the default is the five fp32 ones), all with AdamW and 2 micro
steps per optimizer step, the same model (``--size``) and data: fp32 stage 3 (``s3``), + ``mics_shard_size:
2`` (``s3-mics2``), + ``zero_hpz_partition_size: 2`` (``s3-hpz2``), stage 2 (``s2``), stage 2 + MiCS
(``s2-mics2``); bf16 (ZeRO++ quantises from 16 bits) stage 3 (``bf16-s3``), + hpZ 2 (``bf16-s3-hpz2``), +
hpZ 2 + qwZ + qgZ at 4 bits in blocks of 4096 (``bf16-zeropp``: ``zero_quantized_weights``,
``zero_quantized_gradients``).  Per configuration: the median step time of the measured steps (slowest
rank), the bytes each rank sent inside its node and across nodes per step (zeroshard's counters), the
scale model's prediction of the bytes across nodes (``zeroshard.planning.scale_model.traffic_per_step``,
given the engine's padded bucket sizes and the quantisation) and of the time they take on the link
(``Cluster.seconds`` with the link's bandwidth shared by a node's two ranks), model-state bytes and hpZ's
secondary partition per rank (``memory_breakdown()``), and peak RSS; the table's speed-up is the first
configuration's step time over each one's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
ZEROPP = {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True}


@dataclass(frozen=True)
class Config:
    """One measured configuration: its ``zero_optimization`` keys and whether it trains in bf16."""

    name: str
    zero: dict[str, Any] = field(default_factory=dict)
    bf16: bool = False


CONFIGS: dict[str, Config] = {
    "s3": Config("stage 3", {"stage": 3}),
    "s3-mics2": Config("stage 3 + MiCS 2", {"stage": 3, "mics_shard_size": 2}),
    "s3-hpz2": Config("stage 3 + hpZ 2", {"stage": 3, "zero_hpz_partition_size": 2}),
    "s2": Config("stage 2", {"stage": 2}),
    "s2-mics2": Config("stage 2 + MiCS 2", {"stage": 2, "mics_shard_size": 2}),
    "bf16-s3": Config("bf16 stage 3", {"stage": 3}, bf16=True),
    "bf16-s3-hpz2": Config("bf16 stage 3 + hpZ 2", {"stage": 3, "zero_hpz_partition_size": 2}, bf16=True),
    "bf16-zeropp": Config("bf16 stage 3 + hpZ 2 + qwZ + qgZ 4-bit", {"stage": 3, **ZEROPP}, bf16=True),
}
DEFAULT_CONFIGS = ["s3", "s3-mics2", "s3-hpz2", "s2", "s2-mics2"]
#: the demo GPT's shapes; ``5m`` (4.9M parameters) is this benchmark's own, the others bench_memory.py's
SIZES: dict[str, dict[str, int]] = {
    "5m": dict(vocab_size=256, seq_len=64, d_model=256, n_layer=6, n_head=4),
    "23m": dict(vocab_size=8192, seq_len=128, d_model=384, n_layer=11, n_head=6),
    "91m": dict(vocab_size=8192, seq_len=128, d_model=768, n_layer=12, n_head=12),
}
ACCUM = 2
WORLD, PER_NODE = 4, 2


# ---------------------------------------------------------------------------------------------- worker
def worker(key: str, steps: int, out: str, size: str) -> None:
    """One rank of one configuration (started by `zeroshard run`)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    import zeroshard
    from zeroshard.tools.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    shape = SIZES[size]
    model = GPT(GPTConfig(**shape))
    config = CONFIGS[key]
    zero = {"reduce_bucket_size": 2_000_000, "allgather_bucket_size": 2_000_000,
            "stage3_param_persistence_threshold": 10_000, **config.zero}
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUM, "steps_per_print": 10**6,
        "bf16": {"enabled": config.bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero})
    rank = engine.world.rank
    g = torch.Generator().manual_seed(rank)
    times, sent_at = [], {}
    for step in range(steps):
        if step == 2:
            sent_at = engine.comm.bytes_sent_by_scope()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(ACCUM):
            x = torch.randint(0, shape["vocab_size"], (1, shape["seq_len"]), generator=g)
            engine.backward(engine(x, x))
            engine.step()
        times.append(time.perf_counter() - start)
    sent = {k: (v - sent_at[k]) / (steps - 2) for k, v in engine.comm.bytes_sent_by_scope().items()}
    memory = engine.memory_breakdown()
    record = {"rank": rank, "step_s": statistics.median(times[2:]), "sent": sent,
              "params": sum(p.numel() for p in model.parameters()),
              "param_bytes": engine.precision.compute.itemsize, "grad_bytes": engine.precision.comm.itemsize,
              "model_states": memory["model_states"], "secondary_params": memory.get("secondary_params", 0),
              "padded_buckets": [b.padded_numel for b in engine.storage.layout.buckets],
              "persistent": sorted(getattr(engine.strategy, "plan", None).persistent_buckets)
              if engine.stage == 3 else [],
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    rows: list[Optional[dict]] = [None] * engine.world.world_size
    dist.all_gather_object(rows, record)
    engine.close()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


# ---------------------------------------------------------------------------------------------- launcher
@contextlib.contextmanager
def two_nodes(mbit: int) -> Iterator[Optional[list[tuple[str, str, str]]]]:
    """Two namespaces joined by a veth pair limited to ``mbit`` each way, or None where they cannot be made."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        yield None
        return
    tag = str(os.getpid() % 100000)
    nodes = [(f"zsbA{tag}", f"zsba{tag}", "10.212.7.1"), (f"zsbB{tag}", f"zsbb{tag}", "10.212.7.2")]
    steps = [["ip", "netns", "add", nodes[0][0]], ["ip", "netns", "add", nodes[1][0]],
             ["ip", "link", "add", nodes[0][1], "netns", nodes[0][0], "type", "veth", "peer", "name", nodes[1][1],
              "netns", nodes[1][0]]]
    for ns, dev, addr in nodes:
        steps += [["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev], ["ip", "-n", ns, "link", "set", dev, "up"],
                  ["ip", "-n", ns, "link", "set", "lo", "up"],
                  ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                   "burst", "256kb", "latency", "100ms"]]
    try:
        ok = all(subprocess.run(s, capture_output=True).returncode == 0 for s in steps)
        yield nodes if ok else None
    finally:
        for ns, _, _ in nodes:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_agents(script: Path, worker_args: Sequence[str], nodes: Optional[list[tuple[str, str, str]]], workdir: Path,
               timeout: float = 1800) -> Any:
    """Two agents of two ranks each running ``script --worker ... --out FILE``; what rank 0 wrote to FILE."""
    out = workdir / "rows.json"
    out.unlink(missing_ok=True)
    port = free_port()
    host = nodes[0][2] if nodes else "127.0.0.1"
    agents = []
    for node in range(2):
        prefix, env, extra = [], {**os.environ, "OMP_NUM_THREADS": "1"}, []
        if nodes:
            prefix = ["ip", "netns", "exec", nodes[node][0]]
            env["GLOO_SOCKET_IFNAME"] = nodes[node][1]
            extra = ["--local-addr", nodes[node][2], "--rdzv-conf", f"is_host={node == 0}"]
        command = [*prefix, sys.executable, "-m", "zeroshard.tools.cli", "run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", str(PER_NODE), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}",
                   "--rdzv-id", f"bench{port}", *extra, str(script.resolve()), *worker_args, "--out", str(out)]
        agents.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env=env, cwd=ROOT))
    for agent in agents:
        stdout, _ = agent.communicate(timeout=timeout)
        if agent.returncode != 0:
            raise SystemExit(f"{' '.join(worker_args)}: an agent failed:\n{stdout[-3000:]}")
    return json.loads(out.read_text())


def run_config(key: str, steps: int, size: str, nodes: Optional[list[tuple[str, str, str]]],
               workdir: Path) -> list[dict]:
    return run_agents(Path(__file__), ["--worker", key, "--steps", str(steps), "--size", size], nodes, workdir)


def quantisation(config: Config) -> Any:
    """The scale model's description of the config's qwZ / qgZ (None: neither)."""
    sys.path.insert(0, str(ROOT))
    from zeroshard.planning.quantised_traffic import Quantisation

    zero = config.zero
    if not (zero.get("zero_quantized_weights") or zero.get("zero_quantized_gradients")):
        return None
    return Quantisation(bool(zero.get("zero_quantized_weights")),
                        zero.get("zero_quantized_gradients_bits", 4) if zero.get("zero_quantized_gradients") else None,
                        zero.get("zero_quantized_block_size", 4096))


def predicted(rows: list[dict], config: Config, mbit: int) -> tuple[float, float]:
    """The scale model's bytes across nodes per step for this run's exact (padded) buckets, and the seconds
    they take on a link of ``mbit`` that a node's ranks share (see [Note: link speeds] in
    zeroshard/planning/scale_model.py)."""
    sys.path.insert(0, str(ROOT))
    from zeroshard.planning.scale_model import Cluster, traffic_per_step

    row = rows[0]
    persistent = set(row["persistent"])
    sharded = [n for i, n in enumerate(row["padded_buckets"]) if i not in persistent]
    whole = [n for i, n in enumerate(row["padded_buckets"]) if i in persistent]
    stage, mics, hpz = config.zero["stage"], config.zero.get("mics_shard_size"), config.zero.get("zero_hpz_partition_size")
    p, g, quant = row["param_bytes"], row["grad_bytes"], quantisation(config)
    reuse = config.zero.get("stage3_max_reuse_distance", 10**9)  # the default keeps every unit through backward
    traffics = [traffic_per_step(stage, sharded or whole, WORLD, PER_NODE, ACCUM, p, g, mics_shard_size=mics,
                                 hpz_partition_size=hpz, quantisation=quant, max_reuse_distance=reuse)]
    if stage == 3 and whole and sharded:  # persistent buckets: reduce-scatter (qgZ's too) each micro step,
        # all-gathered once after the step (never quantised), as stage 2 does
        traffics.append(traffic_per_step(2, whole, WORLD, PER_NODE, ACCUM, p, g, mics_shard_size=mics,
                                         quantisation=quant))
    link = mbit * 1e6 / 8
    cluster = Cluster(2, PER_NODE, intra_node_bw=float("inf"), inter_node_bw=link / PER_NODE, tflops=1.0)
    crossing = [c for t in traffics for c in t.by_collective if c.crosses_nodes]
    return sum(c.bytes_sent for c in crossing), sum(cluster.seconds(c) for c in crossing)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", choices=sorted(SIZES), default="5m")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=DEFAULT_CONFIGS)
    parser.add_argument("--inter-node-mbit", type=int, default=500)
    parser.add_argument("--loopback", action="store_true", help="no namespaces: both nodes on the loopback")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "hybrid.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out, args.size)
        return
    results: dict[str, Any] = {"inter_node_mbit": args.inter_node_mbit, "size": args.size, "steps": args.steps,
                               "configs": {}}
    with contextlib.ExitStack() as stack:
        nodes = None if args.loopback else stack.enter_context(two_nodes(args.inter_node_mbit))
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        results["network"] = (f"two network namespaces, veth limited to {args.inter_node_mbit} Mbit/s each way"
                              if nodes else "loopback only (no namespaces): times are not a slow network's")
        for key in args.configs:
            config = CONFIGS[key]
            rows = run_config(key, args.steps, args.size, nodes, Path(tmp))
            across, seconds = predicted(rows, config, args.inter_node_mbit)
            results["configs"][config.name] = {
                "key": key, "params": rows[0]["params"],
                "step_s": max(r["step_s"] for r in rows),
                "across_mb_per_step": rows[0]["sent"]["across_nodes"] / 1e6,
                "inside_mb_per_step": rows[0]["sent"]["inside_node"] / 1e6,
                "predicted_across_mb": across / 1e6,
                "predicted_across_s": seconds,
                "model_states_mib": rows[0]["model_states"] / 2**20,
                "secondary_params_mib": rows[0]["secondary_params"] / 2**20,
                "peak_rss_mib": max(r["peak_rss_mib"] for r in rows)}
            print(config.name, json.dumps(results["configs"][config.name]), flush=True)
    base = next(iter(results["configs"].values()))["step_s"]
    first = next(iter(results["configs"]))
    params = next(iter(results["configs"].values()))["params"]
    print(f"\nGPT {SIZES[args.size]} ({params:,} parameters); world 4 as 2 nodes x 2 ranks; {results['network']}; "
          f"{ACCUM} micro steps per step; median of steps 3-{args.steps}\n")
    print(f"| config | step s | speed-up vs {first} | MB across nodes / step (model) | model s across at {args.inter_node_mbit} "
          "Mbit/s | MB inside / step | model states MiB | secondary MiB | peak RSS MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results["configs"].items():
        print(f"| {name} | {r['step_s']:.3f} | {base / r['step_s']:.2f}x | {r['across_mb_per_step']:.2f} "
              f"({r['predicted_across_mb']:.2f}) | {r['predicted_across_s']:.2f} | {r['inside_mb_per_step']:.2f} | "
              f"{r['model_states_mib']:.1f} | {r['secondary_params_mib']:.1f} | {r['peak_rss_mib']:.0f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
