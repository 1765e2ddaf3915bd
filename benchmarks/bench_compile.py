"""Compiled against eager, interleaved in one world: DDP, FSDP2 and zeroshard's stages, each eager and
compiled, take turns step by step on the same batches.

    .venv/bin/python benchmarks/bench_compile.py [--size 91m] [--stages 0 3] [--precision fp32]
        [--pairs 6] [--warmup 3] [--backend inductor] [--out benchmarks/out/compile_91m_fp32.json]

The GPT, the batches and the optimizer are bench_memory.py's (torch's fused AdamW everywhere, DeepSpeed's
default ``zero_optimization``), two ranks of one thread each, as bench_step_ratio.py measures the stages:
every implementation lives in the same processes, built from the same initial weights, and the steps go
round-robin (the order rotating each round) so that each sees the same minute of this machine.  Compiled
means each transformer block compiled on its own, torchtitan's recipe for FSDP2 (and the recipe zeroshard
keeps its stage-3 hooks outside of: [Note: stage-3 hooks run outside compiled regions] in
zeroshard/sharding/stage3/gather_scheduler.py), for DDP, FSDP2 and zeroshard alike; zeroshard is also
compiled whole through ``engine.compile()`` (what Accelerate calls).  The warm-up steps compile; their
time is reported apart as the compile time.  Reported: each implementation's median step (its slowest
rank's) and its ratio to eager DDP's in the same round, median over rounds.
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


def implementations(stages: list[str]) -> list[str]:
    names = ["ddp", "ddp+blocks", "fsdp2", "fsdp2+blocks"]
    for stage in stages:
        names += [f"zeroshard_{stage}", f"zeroshard_{stage}+blocks", f"zeroshard_{stage}+engine"]
    return names


def compiled(name: str, cfg: GPTConfig, micro: int, precision: str, backend: str):
    """The step function of ``name``: an implementation of bench_memory.py, with ``+blocks`` each block
    compiled before wrapping, with ``+engine`` the engine compiled by ``engine.compile()``."""
    impl, _, how = name.partition("+")
    torch.manual_seed(0)
    model = GPT(cfg)
    if how == "blocks":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=backend)
    step, _ = build(impl, model, micro, precision)
    if how == "engine":
        step.engine.compile(backend=backend)  # type: ignore[attr-defined]
    return step


def worker(rank: int, world: int, names: list[str], cfg_dict: dict, micro: int, precision: str, pairs: int,
           warmup: int, backend: str) -> dict:
    torch.set_num_threads(1)
    cfg = GPTConfig(**cfg_dict)
    steps = {name: compiled(name, cfg, micro, precision, backend) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + pairs):
        x, y = batches(cfg, rank, micro, i)
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            torch.distributed.barrier()  # the other rank's previous step does not leak into this one
            start = time.perf_counter()
            steps[name](x, y, lambda phase: None)
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="91m")
    parser.add_argument("--stages", nargs="+", default=["0", "3"])
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=6, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=3, help="rounds that compile (reported as compile time)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--out", default=None, help="default benchmarks/out/compile_<size>_<precision>.json")
    args = parser.parse_args()
    cfg = SIZES[args.size]
    names = implementations(args.stages)
    ranks = run_world(worker, 2, args=(names, cfg, args.micro_batch, args.precision, args.pairs, args.warmup,
                                       args.backend), timeout=7200, env={"OMP_NUM_THREADS": "1"})
    slowest = {n: [max(r[n][i] for r in ranks) for i in range(args.warmup + args.pairs)] for n in names}
    results = {}
    for n in names:
        measured, ddp = slowest[n][args.warmup:], slowest["ddp"][args.warmup:]
        results[n] = {"median_s": statistics.median(measured),
                      "ratio_to_eager_ddp": statistics.median(m / d for m, d in zip(measured, ddp)),
                      "warmup_s": sum(slowest[n][:args.warmup]), "steps_s": slowest[n]}
    print(f"\nGPT {cfg} ({GPTConfig(**cfg).num_params():,} parameters), {args.precision}, world 2, backend "
          f"{args.backend}, {args.pairs} measured rounds after {args.warmup} warm-up rounds\n")
    print("| implementation | median step s | step / eager DDP step | warm-up s (compiles) |")
    print("| --- | --- | --- | --- |")
    for n, r in results.items():
        print(f"| {n} | {r['median_s']:.3f} | {r['ratio_to_eager_ddp']:.3f} | {r['warmup_s']:.1f} |")
    out = Path(args.out or f"benchmarks/out/compile_{args.size}_{args.precision}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": {**cfg, "micro_batch": args.micro_batch, "world": 2,
                                          "precision": args.precision, "backend": args.backend},
                               "results": results}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
