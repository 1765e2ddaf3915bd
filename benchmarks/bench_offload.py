"""Offload on CPU: the offloaded optimizer step, swap-file throughput, and whole training steps.

    .venv/bin/python benchmarks/bench_offload.py [--nvme /tmp/zeroshard_nvme] [--out benchmarks/out/offload.json]

Part 1 (one process): the optimizer step of a 50M-parameter model (12 x Linear(2048, 2048)) at stage 1,
without offload, with ``offload_optimizer: cpu`` and with ``nvme``, in parameters per second, against
the floor: torch's fused AdamW stepping the same number of elements held in memory.  The NVMe run's
swap thread reports the bytes and seconds it spent reading and writing.
Part 2: the disk's own bandwidth, measured with dd: 1 GiB written and read back, through the page
cache (as zeroshard's swap files are) and with O_DIRECT (the device itself).
Part 3 (world 2, stage 3, a GPT of about 300M parameters built under zeroshard.Init, fp32): median
step time, time per phase, peak RSS per rank (VmHWM) and the breakdown by place, without offload,
with optimizer offload to cpu and to nvme, and with parameters on nvme too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zeroshard  # noqa: E402
from zeroshard.tools.demo.model import GPT, GPTConfig  # noqa: E402
from zeroshard.host.process_memory import host_peak_bytes  # noqa: E402
from zeroshard.tools.testing import run_world  # noqa: E402


def offload(optimizer: str, param: str, nvme: str, sub_group: int) -> dict:
    zero: dict = {"sub_group_size": sub_group,
                  "offload_optimizer": {"device": optimizer, "nvme_path": nvme, "buffer_count": 2}}
    if param != "none":
        zero["offload_param"] = {"device": param, "nvme_path": nvme, "max_in_cpu": 0,
                                 "buffer_size": 20_000_000}
    return zero


def step_worker(rank: int, world: int, optimizer: str, nvme: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(12)])
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 20_000_000,
                              **offload(optimizer, "none", nvme, 10_000_000)}})
    x = torch.randn(8, 2048)
    times = []
    for i in range(steps + 1):
        engine.backward(engine(x).pow(2).mean())
        start = time.perf_counter()
        engine.step()
        if i:
            times.append(time.perf_counter() - start)
    io = engine.updater.swap.io if engine.updater.swap is not None else None
    psi = engine.storage.layout.numel
    out = {"params": psi, "median_step_s": statistics.median(times), "params_per_s": psi / statistics.median(times)}
    if io is not None:
        out.update({"read_mib_s": io.bytes_read / 2**20 / max(io.seconds_reading, 1e-9),
                    "write_mib_s": io.bytes_written / 2**20 / max(io.seconds_writing, 1e-9)})
    return out


def fused_floor(numel: int, steps: int) -> float:
    p = nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return numel / statistics.median(times)


def dd_bandwidth(directory: str) -> dict:
    path = Path(directory) / "dd_probe"
    out = {}
    for mode, wflag, rflag in (("page_cache", [], []), ("direct", ["oflag=direct"], ["iflag=direct"])):
        write = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", "count=256", "conv=fsync", *wflag],
                               capture_output=True, text=True)
        if mode == "direct":
            subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], capture_output=True)
        read = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M", *rflag], capture_output=True, text=True)
        out[mode] = {"write": _dd_rate(write.stderr), "read": _dd_rate(read.stderr)}
    path.unlink(missing_ok=True)
    return out


def _dd_rate(text: str) -> str:
    match = re.search(r"copied, [0-9.]+ s, ([0-9.]+ [kMG]?B/s)", text)
    return match.group(1) if match else text.strip().splitlines()[-1] if text.strip() else "?"


def train_worker(rank: int, world: int, optimizer: str, param: str, nvme: str, steps: int) -> dict:
    cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=1024, n_layer=24, n_head=16)
    torch.manual_seed(0)
    with zeroshard.Init():
        model = GPT(cfg)
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "wall_clock_breakdown": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 20_000_000, "stage3_max_reuse_distance": 0,
                              "stage3_prefetch_bucket_size": 13_000_000,
                              **offload(optimizer, param, nvme, 5_000_000)}})
    times, phases = [], []
    for i in range(steps + 1):
        g = torch.Generator().manual_seed(i * 10 + rank)
        data = torch.randint(0, 256, (1, 65), generator=g)
        start = time.perf_counter()
        engine.backward(engine(data[:, :-1], data[:, 1:]))
        engine.step()
        if i:
            times.append(time.perf_counter() - start)
            phases.append(engine.metrics.timers.take())
        else:
            engine.metrics.timers.take()
    mb = engine.memory_breakdown()
    return {"params": engine.storage.layout.numel, "median_step_s": statistics.median(times),
            "phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
            "peak_rss_mib": host_peak_bytes() / 2**20,
            "breakdown_mib": {k: mb[k] / 2**20 for k in ("params", "grads", "optimizer", "on_device", "on_host",
                                                           "on_nvme", "offload_buffers")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme", default="/tmp/zeroshard_nvme")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--train-steps", type=int, default=2)
    parser.add_argument("--parts", nargs="*", default=["step", "disk", "train"])
    parser.add_argument("--out", default="benchmarks/out/offload.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    os.environ["MALLOC_TRIM_THRESHOLD_"] = "131072"
    Path(args.nvme).mkdir(parents=True, exist_ok=True)
    out_path = Path(args.out)
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    if "step" in args.parts:
        torch.set_num_threads(1)
        step = {mode: run_world(step_worker, 1, args=(mode, args.nvme, args.steps))[0]
                for mode in ("none", "cpu", "nvme")}
        step["fused_adamw_floor_params_per_s"] = fused_floor(step["none"]["params"], args.steps)
        results["optimizer_step"] = step
    if "disk" in args.parts:
        results["disk"] = dd_bandwidth(args.nvme)
    if "train" in args.parts:
        train = {}
        for optimizer, param in (("none", "none"), ("cpu", "none"), ("nvme", "none"), ("nvme", "nvme")):
            ranks = run_world(train_worker, 2, args=(optimizer, param, args.nvme, args.train_steps), timeout=3600)
            train[f"{optimizer}/{param}"] = ranks
            print(f"finished {optimizer}/{param}", flush=True)
        results["train"] = train
    shutil.rmtree(Path(args.nvme), ignore_errors=True)
    print_tables(results)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


def print_tables(results: dict) -> None:
    step = results.get("optimizer_step")
    if step:
        floor = step["fused_adamw_floor_params_per_s"]
        print(f"\nOptimizer step, {step['none']['params']:,} parameters, one process, one thread\n")
        print("| offload_optimizer | step (s) | parameters/s | vs fused AdamW in memory | swap read / write (MiB/s) |")
        print("| --- | --- | --- | --- | --- |")
        print(f"| (fused AdamW, floor) | {step['none']['params'] / floor:.3f} | {floor / 1e6:.0f} M | 1.00 | |")
        for mode in ("none", "cpu", "nvme"):
            r = step[mode]
            io = f"{r['read_mib_s']:.0f} / {r['write_mib_s']:.0f}" if "read_mib_s" in r else ""
            print(f"| {mode} | {r['median_step_s']:.3f} | {r['params_per_s'] / 1e6:.0f} M | "
                  f"{r['params_per_s'] / floor:.2f} | {io} |")
    disk = results.get("disk")
    if disk:
        print("\nDisk under nvme_path (dd, 1 GiB)\n")
        print("| mode | write | read |\n| --- | --- | --- |")
        for mode, r in disk.items():
            print(f"| {mode} | {r['write']} | {r['read']} |")
    train = results.get("train")
    if train:
        psi = train["none/none"][0]["params"]
        print(f"\nStage 3, world 2, GPT with {psi:,} parameters (zeroshard.Init), fp32, micro batch 1 x 64 tokens\n")
        print("| optimizer / params offload | step (s) | forward / backward / step (s) | peak RSS/rank (MiB) | "
              "on device / host / nvme (MiB, rank 0) | offload buffers (MiB) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for key, ranks in train.items():
            r = ranks[0]
            ph = r["phases_s"]
            b = r["breakdown_mib"]
            print(f"| {key} | {max(x['median_step_s'] for x in ranks):.2f} | {ph['forward']:.2f} / "
                  f"{ph['backward']:.2f} / {ph['step']:.2f} | {max(x['peak_rss_mib'] for x in ranks):.0f} | "
                  f"{b['on_device']:.0f} / {b['on_host']:.0f} / {b['on_nvme']:.0f} | {b['offload_buffers']:.0f} |")


if __name__ == "__main__":
    main()
