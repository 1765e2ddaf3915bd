"""Hybrid sharding against full sharding on two "nodes": bytes across nodes, step time and memory.

    .venv/bin/python benchmarks/bench_hybrid.py [--inter-node-mbit 500] [--steps 10] [--out benchmarks/out/hybrid.json]

Two ``zeroshard run`` agents (torchrun, c10d rendezvous), two processes each: world 4 as two nodes of
two.  As root, each agent runs in a network namespace of its own and the two are joined by a veth
pair whose egress is limited with ``tc`` (token bucket) to ``--inter-node-mbit``: traffic between
the ranks of one node stays on that namespace's loopback (unlimited), traffic between nodes crosses
the slow link, as on a cluster whose network is much slower than its intra-node links.  Without
namespaces (not root, no ``ip``/``tc``) both agents share the loopback: the byte counts are the same,
the times say nothing about a slow network.

Configurations, all fp32 with AdamW and 2 micro steps per optimizer step, the same model and data:
stage 3, stage 3 + ``mics_shard_size: 2``, stage 3 + ``zero_hpz_partition_size: 2``, stage 2, stage 2 +
MiCS.  Per configuration: the median step time of the measured steps (slowest rank), the bytes each
rank sent inside its node and across nodes per step (zeroshard's counters), the scale model's
prediction of the bytes across nodes (``zeroshard.planning.scale_model.traffic_per_step``, given the
engine's padded bucket sizes), model-state bytes and hpZ's secondary partition per rank
(``memory_breakdown()``), and peak RSS.
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
from pathlib import Path
from typing import Any, Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
CONFIGS: dict[str, dict[str, Any]] = {
    "stage 3": {"stage": 3},
    "stage 3 + MiCS 2": {"stage": 3, "mics_shard_size": 2},
    "stage 3 + hpZ 2": {"stage": 3, "zero_hpz_partition_size": 2},
    "stage 2": {"stage": 2},
    "stage 2 + MiCS 2": {"stage": 2, "mics_shard_size": 2},
}
ACCUM = 2


# ---------------------------------------------------------------------------------------------- worker
def worker(name: str, steps: int, out: str) -> None:
    """One rank of one configuration (started by `zeroshard run`)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    import zeroshard
    from zeroshard.tools.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, d_model=256, n_layer=6, n_head=4))
    zero = {"reduce_bucket_size": 2_000_000, "allgather_bucket_size": 2_000_000,
            "stage3_param_persistence_threshold": 10_000, **CONFIGS[name]}
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUM, "steps_per_print": 10**6,
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
            x = torch.randint(0, 256, (1, 64), generator=g)
            engine.backward(engine(x, x))
            engine.step()
        times.append(time.perf_counter() - start)
    sent = {k: (v - sent_at[k]) / (steps - 2) for k, v in engine.comm.bytes_sent_by_scope().items()}
    memory = engine.memory_breakdown()
    record = {"rank": rank, "step_s": statistics.median(times[2:]), "sent": sent,
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


def run_config(name: str, steps: int, nodes: Optional[list[tuple[str, str, str]]], workdir: Path) -> list[dict]:
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
                   "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}",
                   "--rdzv-id", f"bench{abs(hash(name))}", *extra, str(Path(__file__).resolve()), "--worker", name,
                   "--steps", str(steps), "--out", str(out)]
        agents.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env=env, cwd=ROOT))
    for agent in agents:
        stdout, _ = agent.communicate(timeout=900)
        if agent.returncode != 0:
            raise SystemExit(f"{name}: an agent failed:\n{stdout[-3000:]}")
    return json.loads(out.read_text())


def predicted_across(rows: list[dict], config: dict[str, Any]) -> float:
    """The scale model's bytes across nodes per step for this run's exact (padded) buckets."""
    sys.path.insert(0, str(ROOT))
    from zeroshard.planning.scale_model import traffic_per_step

    row = rows[0]
    persistent = set(row["persistent"])
    sharded = [n for i, n in enumerate(row["padded_buckets"]) if i not in persistent]
    whole = [n for i, n in enumerate(row["padded_buckets"]) if i in persistent]
    mics, hpz = config.get("mics_shard_size"), config.get("zero_hpz_partition_size")
    traffic = traffic_per_step(config["stage"], sharded or whole, 4, 2, ACCUM, 4, 4, mics_shard_size=mics,
                               hpz_partition_size=hpz)
    total = traffic.inter_bytes
    if config["stage"] == 3 and whole and sharded:  # persistent buckets: reduce-scatter each micro step,
        # all-gathered once after the step, as stage 2 does
        extra = traffic_per_step(2, whole, 4, 2, ACCUM, 4, 4, mics_shard_size=mics)
        total += extra.inter_bytes
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--inter-node-mbit", type=int, default=500)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "hybrid.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return
    results: dict[str, Any] = {"inter_node_mbit": args.inter_node_mbit, "configs": {}}
    with two_nodes(args.inter_node_mbit) as nodes, tempfile.TemporaryDirectory() as tmp:
        results["network"] = (f"two network namespaces, veth limited to {args.inter_node_mbit} Mbit/s each way"
                              if nodes else "loopback only (no namespaces here): times are not a slow network's")
        for name, config in CONFIGS.items():
            rows = run_config(name, args.steps, nodes, Path(tmp))
            results["configs"][name] = {
                "step_s": max(r["step_s"] for r in rows),
                "across_mb_per_step": rows[0]["sent"]["across_nodes"] / 1e6,
                "inside_mb_per_step": rows[0]["sent"]["inside_node"] / 1e6,
                "predicted_across_mb": predicted_across(rows, config) / 1e6,
                "model_states_mib": rows[0]["model_states"] / 2**20,
                "secondary_params_mib": rows[0]["secondary_params"] / 2**20,
                "peak_rss_mib": max(r["peak_rss_mib"] for r in rows)}
            print(name, json.dumps(results["configs"][name]), flush=True)
    base = results["configs"]["stage 3"]["step_s"]
    print(f"\nworld 4 as 2 nodes x 2 ranks; {results['network']}; fp32, {ACCUM} micro steps per step\n")
    print("| config | step s | vs stage 3 | MB across nodes / step (model) | MB inside / step | model states MiB "
          "| secondary MiB | peak RSS MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results["configs"].items():
        print(f"| {name} | {r['step_s']:.3f} | {r['step_s'] / base:.2f} | {r['across_mb_per_step']:.2f} "
              f"({r['predicted_across_mb']:.2f}) | {r['inside_mb_per_step']:.2f} | {r['model_states_mib']:.1f} | "
              f"{r['secondary_params_mib']:.1f} | {r['peak_rss_mib']:.0f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
