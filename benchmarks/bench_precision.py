"""Mixed precision and activation checkpointing on CPU: step time and memory, fp32 vs bf16 vs fp16.

    .venv/bin/python benchmarks/bench_precision.py [--layers 6] [--steps 10] [--out benchmarks/out/precision.json]

Part 1 (world 2, gloo, one intra-op thread per rank): zeroshard stages 0-3 in fp32, bf16 and fp16,
each in a fresh world; median step time, peak RSS per rank (VmHWM), and the model states of
``memory_breakdown()`` next to the formula.  bf16 runs twice: with the default fp32 gradient
accumulation and with ``grad_accum_dtype: bf16`` (the seeds' 2-byte gradients).

Part 2 (one process): the activation memory one forward keeps for backward, with and without
``checkpoint_modules(model, Block)``: resident memory right after the forward minus right before it,
with glibc's mmap threshold pinned at 128 KiB so that freed tensors leave RSS at once.  Also the
step time, which recomputation raises.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zeroshard  # noqa: E402
from zeroshard.checkpointing import checkpoint_modules  # noqa: E402
from zeroshard.tools.demo.model import GPT, Block, GPTConfig  # noqa: E402
from zeroshard.host.process_memory import host_peak_bytes  # noqa: E402
from zeroshard.tools.testing import run_world  # noqa: E402

PRECISIONS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "bf16_accum16": {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}},
    "fp16": {"fp16": {"enabled": True}},
}
BUCKET = 6_250_000


def batches(cfg: GPTConfig, rank: int, micro: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    data = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def config(stage: int, precision: str, micro: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": 4 * BUCKET,
                                  "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 2_000_000},
            **PRECISIONS[precision]}


def stage_worker(rank: int, world: int, stage: int, precision: str, cfg_dict: dict, micro: int,
                 steps: int, warmup: int) -> dict:
    cfg = GPTConfig(**cfg_dict)
    torch.manual_seed(0)
    engine, _, _, _ = zeroshard.initialize(model=GPT(cfg), config=config(stage, precision, micro))
    times, losses = [], []
    for i in range(warmup + steps):
        x, y = batches(cfg, rank, micro, i)
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    mb = engine.memory_breakdown()
    return {"median_step_s": statistics.median(times), "peak_rss_bytes": host_peak_bytes(),
            "model_states": mb["model_states"], "formula": mb["formula"], "params": mb["params"],
            "grads": mb["grads"], "optimizer": mb["optimizer"], "psi": engine.storage.layout.numel,
            "last_loss": losses[-1]}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def activation_run(rank: int, world: int, cfg_dict: dict, micro: int, precision: str, checkpointed: bool,
                   steps: int) -> dict:
    """In a spawned process, so that the pinned mmap threshold applies (glibc reads it at start-up)."""
    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_dict)
    model = GPT(cfg)
    if checkpointed:
        checkpoint_modules(model, Block)
    engine, _, _, _ = zeroshard.initialize(model=model, config=config(0, precision, micro))
    kept, times = [], []
    for i in range(steps + 1):
        x, y = batches(cfg, 0, micro, i)
        start = time.perf_counter()
        before = rss_bytes()
        loss = engine(x, y)
        kept.append(rss_bytes() - before)
        engine.backward(loss)
        engine.step()
        if i:
            times.append(time.perf_counter() - start)
    return {"activation_bytes": statistics.median(kept[1:]), "median_step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--act-micro-batch", type=int, default=16)
    parser.add_argument("--parts", nargs="*", default=["stages", "activations"],
                        help="which tables to measure (the other is kept from --out)")
    parser.add_argument("--out", default="benchmarks/out/precision.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    os.environ["MALLOC_TRIM_THRESHOLD_"] = "131072"
    cfg = dict(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_layer=args.layers,
               n_head=args.d_model // 64)
    out_path = Path(args.out)
    previous = json.loads(out_path.read_text()) if out_path.exists() else {}
    stages = previous.get("stages", {}) if "stages" not in args.parts else {}
    for stage in range(4) if "stages" in args.parts else ():
        for precision in PRECISIONS:
            ranks = run_world(stage_worker, 2, args=(stage, precision, cfg, args.micro_batch, args.steps, args.warmup),
                              timeout=1800)
            stages[f"{stage}/{precision}"] = {
                "median_step_s": max(r["median_step_s"] for r in ranks),
                "peak_rss_mib": max(r["peak_rss_bytes"] for r in ranks) / 2**20,
                "model_states_mib_per_rank": [r["model_states"] / 2**20 for r in ranks],
                "formula_mib": ranks[0]["formula"] / 2**20,
                "params_mib": ranks[0]["params"] / 2**20, "grads_mib": ranks[0]["grads"] / 2**20,
                "optimizer_mib": ranks[0]["optimizer"] / 2**20,
                "psi": ranks[0]["psi"], "last_loss": ranks[0]["last_loss"],
            }
            print(f"finished stage {stage} {precision}", flush=True)
    psi = next(iter(stages.values()))["psi"] if stages else 0
    print(f"\nGPT {cfg}, Ψ = {psi:,}, world 2, micro batch {args.micro_batch}, median of {args.steps} steps\n")
    print("| stage | precision | step (s) | vs fp32 | peak RSS/rank (MiB) | params / grads / optimizer (MiB, rank 0) "
          "| model states/rank (MiB) | formula (MiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, r in stages.items():
        stage, precision = key.split("/")
        base = stages[f"{stage}/fp32"]["median_step_s"]
        states = " / ".join(f"{m:.2f}" for m in r["model_states_mib_per_rank"])
        print(f"| {stage} | {precision} | {r['median_step_s']:.3f} | {r['median_step_s'] / base:.2f} | "
              f"{r['peak_rss_mib']:.0f} | {r['params_mib']:.2f} / {r['grads_mib']:.2f} / {r['optimizer_mib']:.2f} | "
              f"{states} | {r['formula_mib']:.2f} |")
    activations = previous.get("activations", {}) if "activations" not in args.parts else {}
    for precision in ("fp32", "bf16") if "activations" in args.parts else ():
        for checkpointed in (False, True):
            activations[f"{precision}/{'checkpointed' if checkpointed else 'plain'}"] = run_world(
                activation_run, 1, args=(cfg, args.act_micro_batch, precision, checkpointed, args.steps))[0]
    print(f"\nActivation memory kept by one forward, micro batch {args.act_micro_batch} x {args.seq_len} tokens, "
          f"{args.layers} blocks, one process\n")
    print("| precision | blocks | activations kept (MiB) | step (s) |")
    print("| --- | --- | --- | --- |")
    for key, r in activations.items():
        precision, mode = key.split("/")
        print(f"| {precision} | {mode} | {r['activation_bytes'] / 2**20:.1f} | {r['median_step_s']:.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": cfg, "args": vars(args), "stages": stages,
                                          "activations": activations}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
