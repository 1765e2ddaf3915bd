"""What reliability costs, and whether a long run leaks: the per-call consistency check, and a soak run.

    .venv/bin/python benchmarks/bench_reliability.py [--soak-steps 1000] [--out benchmarks/out/reliability.json]

1. **Consistency check** (zeroshard/distributed/consistency.py): every forward/backward/step/save/load
   call all-gathers five integers over a gloo group of its own.  Measured at world 2 on the ~20M GPT of
   bench_stages.py (stages 2 and 3): the step time (median of steps 3-12, slowest rank), the check's
   own time per call (median of 200 calls in isolation) and its calls per step, hence its share.
2. **Soak**: the tiny GPT of the tests at world 2, stage 2, ``--soak-steps`` optimizer steps with a
   periodic save every 50 (``checkpoint.keep_last: 2``) and, half-way, ``engine.close()`` and a new
   ``initialize(resume_from=...)`` in the same processes.  Recorded: each rank's RSS after the warm-up
   (step 100) and at the end, open file descriptors at both points, and every file left in the save
   directory besides the two kept checkpoints and ``latest``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zeroshard  # noqa: E402
from zeroshard.tools.demo.model import GPT, GPTConfig  # noqa: E402
from zeroshard.distributed.collectives import CommKind  # noqa: E402
from zeroshard.distributed.consistency import Call  # noqa: E402
from zeroshard.tools.testing import run_world  # noqa: E402

BIG = GPTConfig(vocab_size=256, seq_len=128, d_model=384, n_layer=11, n_head=6)
TINY = GPTConfig(vocab_size=61, seq_len=8, d_model=16, n_layer=2, n_head=2, attn_bias=False)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def check_cost_worker(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    engine, _, _, _ = zeroshard.initialize(model=GPT(BIG), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": stage}})
    x = torch.randint(0, 256, (2, BIG.seq_len))
    times = []
    for _ in range(12):
        dist.barrier()
        start = time.perf_counter()
        engine.backward(engine(x, x))
        engine.step()
        times.append(time.perf_counter() - start)
    checks = engine._agree.own.counters[CommKind.ALL_GATHER]  # the check's own group counts only checks
    calls_before = checks.calls
    engine.backward(engine(x, x))
    engine.step()
    calls_per_step = checks.calls - calls_before
    per_call = []
    for _ in range(200):
        start = time.perf_counter()
        engine._agree.agree(Call.STEP, engine.micro_steps, engine.global_steps)
        per_call.append(time.perf_counter() - start)
    engine.close()
    return {"step_s": statistics.median(times[2:]), "check_s": statistics.median(per_call),
            "calls_per_step": calls_per_step}


def soak_worker(rank: int, world: int, steps: int, directory: str) -> dict:
    save_dir = Path(directory) / "ckpt"
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
              "checkpoint": {"save_dir": str(save_dir), "save_interval": 50, "keep_last": 2}}

    def build():
        torch.manual_seed(0)
        engine, _, _, _ = zeroshard.initialize(model=GPT(TINY), config=config, resume_from=save_dir)
        return engine

    engine = build()
    warm: dict = {}
    started = time.perf_counter()
    while engine.global_steps < steps:
        g = torch.Generator().manual_seed(engine.global_steps * 10 + rank)
        data = torch.randint(0, TINY.vocab_size, (4, TINY.seq_len + 1), generator=g)
        engine.backward(engine(data[:, :-1], data[:, 1:]))
        engine.step()
        if engine.global_steps == 100:
            warm = {"rss_mib": rss_mib(), "fds": open_fds()}
        if engine.global_steps == steps // 2:  # a resume in the middle, in the same process
            engine.close()
            engine = build()
    seconds = time.perf_counter() - started
    end = {"rss_mib": rss_mib(), "fds": open_fds()}
    engine.close()
    dist.barrier()
    expected = {"latest", f"global_step{steps}", f"global_step{steps - 50}"}
    left = sorted(str(p.relative_to(save_dir)) for p in save_dir.iterdir() if p.name not in expected)
    return {"warm": warm, "end": end, "seconds": seconds, "left_over": left,
            "kept": sorted(p.name for p in save_dir.iterdir() if p.name in expected)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--soak-steps", type=int, default=1000)
    parser.add_argument("--out", default=str(Path(__file__).parent / "out" / "reliability.json"))
    args = parser.parse_args()
    results: dict = {"check": {}, "soak": {}}
    print("| stage | step (s) | check per call (ms) | calls per step | share of a step |")
    print("| --- | --- | --- | --- | --- |")
    for stage in (2, 3):
        ranks = run_world(check_cost_worker, 2, args=(stage,), timeout=900)
        step = max(r["step_s"] for r in ranks)
        check = max(r["check_s"] for r in ranks)
        calls = ranks[0]["calls_per_step"]
        share = calls * check / step
        results["check"][stage] = {"ranks": ranks, "share": share}
        print(f"| {stage} | {step:.3f} | {check * 1e3:.3f} | {calls} | {100 * share:.2f}% |")
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_world(soak_worker, 2, args=(args.soak_steps, tmp), timeout=3600)
    print()
    print("| rank | RSS at step 100 (MiB) | RSS at the end (MiB) | drift | fds at 100 / end | left over | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rank, r in enumerate(ranks):
        drift = r["end"]["rss_mib"] / r["warm"]["rss_mib"] - 1
        r["drift"] = drift
        print(f"| {rank} | {r['warm']['rss_mib']:.1f} | {r['end']['rss_mib']:.1f} | {100 * drift:+.2f}% | "
              f"{r['warm']['fds']} / {r['end']['fds']} | {r['left_over'] or 'nothing'} | {r['seconds']:.1f} |")
    results["soak"] = {"steps": args.soak_steps, "ranks": ranks}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
