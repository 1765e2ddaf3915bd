"""ZeRO++'s quantised communication against none: the loss of the same bf16 run, step by step.

    .venv/bin/python benchmarks/bench_zeropp_convergence.py [--steps 300] [--size 5m] [--every 25]
        [--configs bf16-s3 bf16-zeropp] [--namespaces] [--out benchmarks/out/zeropp_convergence.json]

World 4 as two nodes of two ``zeroshard run`` agents (bench_hybrid.py's launcher), both on the loopback
unless ``--namespaces`` (the link changes the time, not the loss): zeroshard sees two nodes either way, so
qgZ reduces in two hops.  Every configuration trains the demo GPT (``--size``, bench_hybrid.py's shapes,
vocabulary 256) from the same seed on the same text: the Python standard library's source as bytes
(``zeroshard.tools.demo.data``), each rank's micro batches fixed windows chosen by step, rank and micro
step, never repeated within the run.  bf16, AdamW lr 1e-3 (10% warm-up, then constant), micro batch 2, 2
micro steps per step, gradient clipping 1.0.  The loss of a step is the mean over the world's micro batches;
the table shows every ``--every`` steps' loss and the mean of the last 10 steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hybrid import ACCUM, CONFIGS, ROOT, SIZES, run_agents, two_nodes  # noqa: E402

MICRO, LR = 2, 1e-3


def worker(key: str, steps: int, out: str, size: str) -> None:
    """One rank of one configuration (started by `zeroshard run`)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    import zeroshard
    from zeroshard.tools.demo.data import ByteWindows, stdlib_bytes
    from zeroshard.tools.demo.model import GPT, GPTConfig

    shape = {**SIZES[size], "vocab_size": 256}
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape))
    config = CONFIGS[key]
    warmup = max(1, steps // 10)
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM, "steps_per_print": 10**6,
        "gradient_clipping": 1.0, "bf16": {"enabled": config.bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": LR,
                                                     "warmup_num_steps": warmup, "warmup_type": "linear"}},
        "zero_optimization": {"reduce_bucket_size": 2_000_000, "allgather_bucket_size": 2_000_000,
                              "stage3_param_persistence_threshold": 10_000, **config.zero}})
    rank, world = engine.world.rank, engine.world.world_size
    windows = ByteWindows(stdlib_bytes(), shape["seq_len"])
    per_step = world * ACCUM * MICRO
    assert steps * per_step <= len(windows), "not enough text for distinct windows"
    losses, start = [], time.perf_counter()
    for step in range(steps):
        total = 0.0
        for micro in range(ACCUM):
            first = step * per_step + (micro * world + rank) * MICRO
            x, y = (torch.stack(t) for t in zip(*(windows[i] for i in range(first, first + MICRO))))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach()) / ACCUM
        losses.append(total)
        if rank == 0 and (step + 1) % 25 == 0:  # how far a long run is, while it runs
            Path(out).with_suffix(".progress").write_text(f"step {step + 1} of {steps}: loss {total:.4f}\n")
    seconds = time.perf_counter() - start
    every: list[list[float]] = [[] for _ in range(world)]
    dist.all_gather_object(every, losses)
    engine.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"losses": [statistics.fmean(s) for s in zip(*every)], "seconds": seconds,
                                         "params": sum(p.numel() for p in model.parameters())}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--size", choices=sorted(SIZES), default="5m")
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["bf16-s3", "bf16-zeropp"])
    parser.add_argument("--namespaces", action="store_true", help="the two nodes in namespaces (500 Mbit/s link)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "zeropp_convergence.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out, args.size)
        return
    runs: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        nodes = stack.enter_context(two_nodes(500)) if args.namespaces else None
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for key in args.configs:
            runs[CONFIGS[key].name] = run_agents(Path(__file__), ["--worker", key, "--steps", str(args.steps),
                                                                  "--size", args.size], nodes, tmp,
                                                       timeout=24 * 3600)  # a long run's agents are not stuck
            print(CONFIGS[key].name, f"{runs[CONFIGS[key].name]['seconds']:.0f} s", flush=True)
    names = list(runs)
    base = names[0]
    shown = sorted({0, *range(args.every - 1, args.steps, args.every), args.steps - 1})
    params = runs[base]["params"]
    print(f"\nGPT {({**SIZES[args.size], 'vocab_size': 256})} ({params:,} parameters), world 4 as 2 nodes x 2, "
          f"micro batch {MICRO} x {ACCUM}, {args.steps} steps\n")
    print("| step | " + " | ".join(names) + " | difference |")
    print("| --- |" + " --- |" * (len(names) + 1))
    for step in [*shown, "last 10"]:
        values = [statistics.fmean(runs[n]["losses"][-10:]) if step == "last 10" else runs[n]["losses"][step]
                  for n in names]
        label = step if step == "last 10" else step + 1
        print(f"| {label} | " + " | ".join(f"{v:.4f}" for v in values)
              + f" | {100 * (values[-1] - values[0]) / values[0]:+.2f}% |")
    print("\nseconds: " + ", ".join(f"{n} {runs[n]['seconds']:.0f}" for n in names))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"size": args.size, "steps": args.steps, "runs": runs}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
