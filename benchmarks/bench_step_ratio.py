"""Step time against DDP, interleaved: each zeroshard stage and DDP take turns, step by step, in one world.

    .venv/bin/python benchmarks/bench_step_ratio.py [--size 91m] [--stages 0 1 2 3] [--pairs 8] [--warmup 2]
        [--out benchmarks/out/step_ratio_91m.json]
    .venv/bin/python benchmarks/bench_step_ratio.py --stages 2 2_overlap   # overlap_param_gather

bench_memory.py runs every implementation in a world of its own, one after the other; on a machine
whose speed drifts by 10-30% from minute to minute (the 2-core VM of benchmarks/RESULTS.md) a ratio of
two such runs says more about the minute than about the engine: stage 0, which communicates exactly
as DDP does, measured 0.90x to 1.12x across separate runs.  Here each stage shares its world with DDP: the
same processes (2 ranks x 1 thread, gloo, OMP_NUM_THREADS=1) build both, from the same initial
weights, and alternate steps on the same batches (DDP first in even pairs, the stage first in odd
ones), so that both see the same minute.  Everything else is bench_memory.py's: the GPT, the batches,
torch's fused AdamW for both, DeepSpeed's default ``zero_optimization`` values, glibc's default
allocator.  Per pair, each step's time is its slowest rank's; reported per stage: the median over
pairs of (stage step / DDP step), and each side's median step.  Target of issue #15: <= 1.03.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_memory import SIZES, batches, build  # noqa: E402
from zeroshard.tools.demo.model import GPT, GPTConfig  # noqa: E402
from zeroshard.tools.testing import run_world  # noqa: E402


def worker(rank: int, world: int, stage: str, cfg_dict: dict, micro: int, pairs: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    cfg = GPTConfig(**cfg_dict)
    steps = {}
    for impl in ("ddp", f"zeroshard_{stage}"):
        torch.manual_seed(0)
        steps[impl], _ = build(impl, GPT(cfg), micro, "fp32")
    times: dict[str, list[float]] = {impl: [] for impl in steps}
    for i in range(warmup + pairs):
        x, y = batches(cfg, rank, micro, i)
        order = list(steps) if i % 2 == 0 else list(reversed(steps))
        for impl in order:
            torch.distributed.barrier()  # the other rank's previous step does not leak into this one
            start = time.perf_counter()
            steps[impl](x, y, lambda phase: None)
            if i >= warmup:
                times[impl].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="91m")
    parser.add_argument("--stages", nargs="+", default=["0", "1", "2", "3"],
                        help="stages, or bench_memory.py's variants of one: 1_overlap, 2_overlap, 3_trim, ...")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=8, help="measured (DDP step, stage step) pairs")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None, help="default benchmarks/out/step_ratio_<size>.json")
    args = parser.parse_args()
    cfg = SIZES[args.size]
    results: dict[str, dict] = {}
    for stage in args.stages:
        ranks = run_world(worker, 2, args=(stage, cfg, args.micro_batch, args.pairs, args.warmup),
                          timeout=3600, env={"OMP_NUM_THREADS": "1"})
        ddp = [max(r["ddp"][i] for r in ranks) for i in range(args.pairs)]
        mine = [max(r[f"zeroshard_{stage}"][i] for r in ranks) for i in range(args.pairs)]
        ratios = [m / d for m, d in zip(mine, ddp)]
        results[stage] = {"ratio_median": statistics.median(ratios), "ratios": ratios,
                          "ddp_median_s": statistics.median(ddp), "stage_median_s": statistics.median(mine),
                          "ddp_s": ddp, "stage_s": mine}
        print(f"finished stage {stage}: {statistics.median(ratios):.3f}x DDP", flush=True)
    print(f"\nGPT {cfg} ({GPTConfig(**cfg).num_params():,} parameters), fp32, world 2, "
          f"{args.pairs} interleaved pairs per stage\n")
    print("| stage | step / DDP step, median of pairs (min-max) | stage median s | DDP median s (same world) | target |")
    print("| --- | --- | --- | --- | --- |")
    for stage, r in results.items():
        print(f"| {stage} | {r['ratio_median']:.3f} ({min(r['ratios']):.3f}-{max(r['ratios']):.3f}) | "
              f"{r['stage_median_s']:.2f} | {r['ddp_median_s']:.2f} | <= 1.03 |")
    out = Path(args.out or f"benchmarks/out/step_ratio_{args.size}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": {**cfg, "micro_batch": args.micro_batch, "world": 2},
                               "stages": results}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
