"""FP8 training on CPU at world 2: fp32 vs bf16 vs FP8 (bf16 with FP8 layers) at ZeRO stages 0 and 3.

    .venv/bin/python benchmarks/bench_fp8.py [--steps 200] [--size 20m|small] [--stages 0 3] [--recipe tensorwise]
        [--micro-batch 4] [--seq-len 128] [--out benchmarks/out/fp8.json]

A ~20M-parameter byte-level GPT (zeroshard/tools/demo/model.py: d_model 512, 6 layers, seq 128, vocabulary
256; ``--size small``: d_model 256, 4 layers, 3.2M; ``--seq-len`` shortens the sequence, which leaves the
parameters but for the position embedding as they are, and so the tokens a step) trains on deterministic data (the same batches for every run) with AdamW at world 2 (gloo, one
intra-op thread per rank), each run in a fresh world.  Per run: the loss curve and final loss, the median
step time, the all-gather bytes per step from the ledger (stage 3 gathers the blocks' weights; FP8 runs
gather them in FP8 unless ``--hp-gathers``) and the peak RSS per rank (VmHWM).  FP8 runs are bf16 runs
with the ``fp8`` block on (the head stays in bf16).  On a CPU, FP8 GEMMs (``torch._scaled_mm``) are not
faster than bf16 ones; the step times say so honestly, and the GPU check (scripts/gpu_check.sh) measures
the speed-up where FP8 has hardware.
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
from zeroshard.distributed.collectives import CommKind  # noqa: E402
from zeroshard.host.process_memory import host_peak_bytes  # noqa: E402
from zeroshard.tools.demo.model import GPT, GPTConfig  # noqa: E402
from zeroshard.tools.testing import run_world  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp8")
SIZES = {"20m": dict(vocab_size=256, seq_len=128, d_model=512, n_layer=6, n_head=8),
         # FP8 GEMMs run slowly on a CPU (no FP8 units): the small model keeps 200 steps within minutes here
         "small": dict(vocab_size=256, seq_len=128, d_model=256, n_layer=4, n_head=4)}
BUCKET = 6_250_000


def batch(cfg: GPTConfig, rank: int, micro: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data: a fixed mixture of repeating byte patterns, so that the loss falls."""
    g = torch.Generator().manual_seed(step * 100 + rank)
    period = torch.randint(3, 17, (micro, 1), generator=g)
    phase = torch.randint(0, 256, (micro, 1), generator=g)
    pos = torch.arange(cfg.seq_len + 1)
    data = (phase + (pos % period) * 7) % cfg.vocab_size
    return data[:, :-1], data[:, 1:]


def config(stage: int, precision: str, micro: int, recipe: str, hp_gathers: bool) -> dict:
    out = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9, "seed": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": 4 * BUCKET,
                                 "stage3_param_persistence_threshold": 10_000}}
    if precision != "fp32":
        out["bf16"] = {"enabled": True}
    if precision == "fp8":
        out["fp8"] = {"enabled": True, "recipe": recipe, "gather_weights_in_fp8": not hp_gathers}
    return out


def run(rank: int, world: int, stage: int, precision: str, micro: int, steps: int, recipe: str,
        hp_gathers: bool, model: dict) -> dict:
    cfg = GPTConfig(**model)
    torch.manual_seed(0)
    engine, _, _, _ = zeroshard.initialize(model=GPT(cfg), config=config(stage, precision, micro, recipe, hp_gathers))
    losses, times = [], []
    gathered = 0
    for step in range(steps):
        x, y = batch(cfg, rank, micro, step)
        log = engine.comm.ledger.start_log()
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        gathered = sum(r.full_bytes for r in log if r.kind is CommKind.ALL_GATHER)
        losses.append(float(loss.detach()))
    params = sum(p.numel() for p in GPT(cfg).parameters())
    engine.close()
    return {"losses": losses, "median_step_s": statistics.median(times[1:] or times),
            "all_gather_bytes_per_step": gathered, "peak_rss_bytes": host_peak_bytes(), "params": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--size", choices=sorted(SIZES), default="20m")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=None, help="the sequence length (default: the size's)")
    parser.add_argument("--stages", type=int, nargs="*", default=[0, 3])
    parser.add_argument("--precisions", nargs="*", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--hp-gathers", action="store_true", help="FP8 runs gather weights in bf16 at stage 3")
    parser.add_argument("--out", default="benchmarks/out/fp8.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = {**SIZES[args.size], **({"seq_len": args.seq_len} if args.seq_len else {})}
    results: dict[str, dict] = {}
    for stage in args.stages:
        for precision in args.precisions:
            ranks = run_world(run, 2, args=(stage, precision, args.micro_batch, args.steps, args.recipe,
                                            args.hp_gathers, model), timeout=24 * 3600)
            results[f"{stage}/{precision}"] = {
                "final_loss": ranks[0]["losses"][-1], "losses": ranks[0]["losses"],
                "last10_loss": statistics.mean(ranks[0]["losses"][-10:]),
                "median_step_s": max(r["median_step_s"] for r in ranks),
                "all_gather_bytes_per_step": ranks[0]["all_gather_bytes_per_step"],
                "peak_rss_mib": max(r["peak_rss_bytes"] for r in ranks) / 2**20, "params": ranks[0]["params"]}
            print(f"finished stage {stage} {precision}", flush=True)
    print(f"\nGPT {model}, world 2, micro batch {args.micro_batch}, {args.steps} steps, recipe {args.recipe}\n")
    print("| stage | precision | final loss | vs bf16 | vs fp32 | step (s) | all-gather bytes/step "
          "| peak RSS/rank (MiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, r in results.items():
        stage, precision = key.split("/")
        bf16, fp32 = (results.get(f"{stage}/{p}", {}).get("final_loss") for p in ("bf16", "fp32"))
        versus = [f"{r['final_loss'] / ref - 1:+.2%}" if ref else "-" for ref in (bf16, fp32)]
        print(f"| {stage} | {precision} | {r['final_loss']:.4f} | {versus[0]} | {versus[1]} | {r['median_step_s']:.3f} | "
              f"{r['all_gather_bytes_per_step']:,} | {r['peak_rss_mib']:.0f} |")
    every = max(1, args.steps // 8)
    marks = sorted({0, *range(every - 1, args.steps, every), args.steps - 1})
    print(f"\nloss at steps {', '.join(str(m + 1) for m in marks)}; then the mean of the last 10 steps\n")
    for key, r in results.items():
        curve = " / ".join(f"{r['losses'][m]:.4f}" for m in marks)
        print(f"| {key} | {curve} | {r['last10_loss']:.4f} | {r['params']:,} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "steps": args.steps, "recipe": args.recipe,
                               "hp_gathers": args.hp_gathers, "results": results}, indent=1))


if __name__ == "__main__":
    main()
