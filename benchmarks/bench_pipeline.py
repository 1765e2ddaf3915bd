"""Pipeline parallelism: the measured bubble against theory, and stage 3's memory against data parallelism.

    .venv/bin/python benchmarks/bench_pipeline.py [--steps 6] [--warmup 2] [--rows 512] [--world 4]
                                                  [--out benchmarks/out/pipeline.json]

A stack of ``LAYERS`` equal blocks (``Linear(WIDTH, WIDTH)`` + GELU), fp32, SGD, micro-batches of
``--rows`` rows, at world 4:

- **Bubble**: at world ``--world`` (4: pipeline 2 x data 2 and 4 x 1; 2: pipeline 2 x data 1), ZeRO-1,
  schedules ``1f1b``, ``gpipe`` and ``interleaved_1f1b`` with two chunks per stage, ``m`` in (4, 8)
  micro-batches per batch.  Per configuration, the measured idle fraction (``engine.last_batch_timing``:
  idle / (busy + idle), averaged over the ranks and the measured batches, see [Note: the measured
  bubble] in zeroshard/pipeline/executor.py) beside the schedule's theory, ``(p - 1) / (v m + p - 1)``
  with ``v`` chunks per stage, and the median batch time (the slowest rank's).  One world runs them all.
- **Memory** at ZeRO stage 3, ``m`` = 8: pipeline 2 x data 2 (the stage's parameters gathered once per
  batch, the default, and per micro-batch with ``pipeline.stage3_gather_per_micro_batch``) against data
  4 (a plain engine over the same layers as one ``nn.Sequential``, the same global batch): per rank,
  model-state bytes (``memory_breakdown()``) and peak RSS, one world each so that the peaks are their own.

Each rank computes with one thread: the ranks share the machine's cores, and a rank that waits must
not slow the others, or the measured bubble says more about the machine than the schedule.  With fewer
free cores than ranks the ranks compete and the idle fractions come out wrong: ``--world 2`` measures
the bubble on two cores (the memory rows always run at world 4: bytes do not depend on the cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from zeroshard.tools.testing import run_world  # noqa: E402

LAYERS, WIDTH, LR = 8, 512, 1e-3
#: the schedules of the bubble grid, with their chunks per stage
SCHEDULE_CHUNKS = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2))


def bubble_configs(world: int) -> list[tuple[int, str, int, int]]:
    """The bubble grid at ``world`` ranks: (pipeline depth, schedule, chunks, micro-batches per batch)."""
    return [(pp, schedule, chunks, m) for pp in (2, 4) if world % pp == 0 for schedule, chunks in SCHEDULE_CHUNKS
            for m in (4, 8)]
#: the memory rows: (name, pipeline depth, stage3_gather_per_micro_batch)
MEMORY_CONFIGS = [("pipeline 2 x data 2, gathered per batch", 2, False),
                  ("pipeline 2 x data 2, gathered per micro-batch", 2, True),
                  ("data 4", 1, False)]
MEMORY_MICRO_BATCHES = 8


class Block(nn.Module):
    """One of the stack's equal layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.fc(x))


def _pipeline(pp: int, stage: int, schedule: str, m: int, rows: int, per_micro_batch: bool = False,
              chunks: int = 1, world: int = 4) -> Any:
    import zeroshard
    from zeroshard.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    module = PipelineModule([LayerSpec(Block) for _ in range(LAYERS)], num_stages=pp,
                            loss_fn=nn.functional.mse_loss, seed_layers=True, partition_method="uniform",
                            virtual_stages=chunks)
    dp = world // pp
    engine, _, _, _ = zeroshard.initialize(model=module, model_parameters=module.parameters(), config={
        "train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": m,
        "train_batch_size": rows * m * dp, "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
        "pipeline": {"schedule": schedule, "stage3_gather_per_micro_batch": per_micro_batch}})
    return engine


def _batches(rank: int, m: int, rows: int) -> Any:
    g = torch.Generator().manual_seed(rank)
    return iter([(torch.randn(rows, WIDTH, generator=g), torch.zeros(rows, WIDTH)) for _ in range(m)])


def bubble_worker(rank: int, world: int, steps: int, warmup: int, rows: int) -> list[dict[str, Any]]:
    """Every configuration of the bubble grid at ``world`` ranks, one after the other."""
    import time

    torch.set_num_threads(1)
    out = []
    for pp, schedule, chunks, m in bubble_configs(world):
        engine = _pipeline(pp, 1, schedule, m, rows, chunks=chunks, world=world)
        fractions, times = [], []
        for step in range(warmup + steps):
            started = time.perf_counter()
            engine.train_batch(_batches(rank % (world // pp), m, rows))
            if step >= warmup:
                times.append(time.perf_counter() - started)
                timing = engine.last_batch_timing
                fractions.append(timing.idle_fraction)
        out.append({"pp": pp, "schedule": schedule, "m": m, "stage": engine.stage_id,
                    "idle_fraction": statistics.mean(fractions), "times": times})
        engine.close()
    return out


def memory_worker(rank: int, world: int, pp: int, per_micro_batch: bool, steps: int, rows: int) -> dict[str, Any]:
    import zeroshard

    torch.set_num_threads(1)
    m = MEMORY_MICRO_BATCHES
    if pp > 1:
        engine = _pipeline(pp, 3, "1f1b", m, rows, per_micro_batch)
        for _ in range(steps):
            engine.train_batch(_batches(rank % (4 // pp), m, rows))
    else:  # the same global batch: 4 ranks x m / 2 micro-batches of `rows`
        torch.manual_seed(0)
        model = nn.Sequential(*[Block() for _ in range(LAYERS)])
        engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": m // 2,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": 3},
            "steps_per_print": 10**9})
        for _ in range(steps):
            for x, y in _batches(rank, m // 2, rows):
                engine.backward(nn.functional.mse_loss(engine(x), y))
                engine.step()
    memory = engine.memory_breakdown()
    engine.close()
    return {"model_states": memory["model_states"],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    from zeroshard.pipeline.schedule import PipeSchedule

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", type=int, default=512, help="rows per micro-batch")
    parser.add_argument("--world", type=int, default=4, choices=(2, 4),
                        help="ranks of the bubble grid (one core each); the memory rows run at 4")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "pipeline.json"))
    args = parser.parse_args()

    ranks = run_world(bubble_worker, args.world, args=(args.steps, args.warmup, args.rows), timeout=3600)
    bubble = []
    for index, (pp, schedule, chunks, m) in enumerate(bubble_configs(args.world)):
        per_rank = [r[index] for r in ranks]
        row = {"pp": pp, "dp": args.world // pp, "schedule": schedule, "chunks": chunks, "m": m,
               "idle_fraction": statistics.mean(r["idle_fraction"] for r in per_rank),
               "idle_by_rank": [r["idle_fraction"] for r in per_rank],
               "theory": PipeSchedule.bubble_fraction(pp, m, chunks),
               "batch_s": statistics.median(max(r["times"][i] for r in per_rank) for i in range(args.steps))}
        bubble.append(row)
        print(json.dumps(row), flush=True)
    memory = []
    for name, pp, per_micro_batch in MEMORY_CONFIGS:
        ranks = run_world(memory_worker, 4, args=(pp, per_micro_batch, args.steps, args.rows), timeout=3600)
        row = {"config": name, "model_states_mib": max(r["model_states"] for r in ranks) / 2**20,
               "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks)}
        memory.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"bubble": bubble, "memory": memory, "layers": LAYERS, "width": WIDTH,
                                          "rows": args.rows, "steps": args.steps}, indent=2))
    print(f"\n{LAYERS} x Linear({WIDTH}, {WIDTH}) + GELU, {args.rows} rows per micro-batch, world {args.world}, "
          f"ZeRO-1\n")
    print("| pipeline x data | schedule (chunks) | micro-batches | measured idle | theory (p-1)/(vm+p-1) | batch (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in bubble:
        print(f"| {r['pp']} x {r['dp']} | {r['schedule']} ({r['chunks']}) | {r['m']} | {r['idle_fraction']:.1%} | "
              f"{r['theory']:.1%} | {r['batch_s']:.3f} |")
    print(f"\nZeRO stage 3, {MEMORY_MICRO_BATCHES} micro-batches per pipeline batch (the same global batch)\n")
    print("| configuration | model states/rank (MiB) | peak RSS/rank (MiB) |")
    print("| --- | --- | --- |")
    for r in memory:
        print(f"| {r['config']} | {r['model_states_mib']:.1f} | {r['peak_rss_mib']:.0f} |")


if __name__ == "__main__":
    main()
