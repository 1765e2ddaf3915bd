"""What one gradient bucket's collectives cost on this host, and whether they overlap with compute at all.

    .venv/bin/python benchmarks/bench_collectives.py [--elements 11430720] [--reps 8]
        [--out benchmarks/out/collectives.json] [--pieces-kib 1024 2048 8192]

Why: in ring arithmetic an all-reduce is a reduce-scatter plus an all-gather, so ZeRO stages 1-2 move
the bytes DDP moves (the seeds' argument) and their step should cost what DDP's does.  Whether that
holds depends on the backend's implementations and on the cores left for communication.  This times,
in a world of 2 gloo ranks x 1 thread (bench_memory.py's and bench_step_ratio.py's setting), one
bucket of ``--elements`` fp32 values (default: 1/8 of the 91M benchmark model, the bucket stages 0-2
use under DeepSpeed's default ``reduce_bucket_size``):

- DDP's collective: ``all_reduce`` in place;
- stages 1-2's: zeroshard's ``Collectives.reduce_scatter`` (in place, in pieces on gloo) and
  ``Collectives.all_gather`` (the post-step parameter gather), and torch's tensor forms beside them;
- overlap: a fixed amount of matmul work alone, the all-reduce alone, and the all-reduce launched
  asynchronously just before the same work and waited for after it.  With a core to spare the third
  costs max(work, collective); with none, work + collective.

Per step, a model of B buckets costs DDP B all-reduces and stages 1-2 B reduce-scatters and B
all-gathers (stage 3 adds a second gather per unit, in backward); the table prints those sums.
Median of ``--reps`` after one warm-up, slowest rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zeroshard.distributed.collectives as collectives  # noqa: E402
from zeroshard.distributed.collectives import Collectives  # noqa: E402
from zeroshard.distributed.world import World  # noqa: E402
from zeroshard.tools.testing import run_world  # noqa: E402

#: buckets of the 91M benchmark model per step under DeepSpeed's defaults (stages 0-2 cap a bucket at 1/8)
BUCKETS_91M = 8


def worker(rank: int, world_size: int, elements: int, reps: int, pieces_kib: list[int]) -> dict[str, float]:
    torch.set_num_threads(1)
    comm = Collectives(World(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"),
                             backend="gloo"))
    full = torch.randn(elements)
    chunk = elements // world_size
    own = full[rank * chunk:(rank + 1) * chunk]
    params = own.clone()
    a, b = torch.randn(768, 3072), torch.randn(3072, 768)
    out: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], object]) -> None:
        times = []
        for i in range(reps + 1):
            dist.barrier()
            start = time.perf_counter()
            fn()
            if i:
                times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)

    def work() -> None:
        for _ in range(12):
            torch.mm(a, b)

    timed("all_reduce", lambda: dist.all_reduce(full))
    timed("reduce_scatter", lambda: comm.reduce_scatter(own, full, "bucket"))
    timed("all_gather", lambda: comm.all_gather(full, params, "bucket"))
    timed("reduce_scatter_tensor_form", lambda: dist.reduce_scatter_tensor(own, full))
    timed("all_gather_tensor_form", lambda: dist.all_gather_into_tensor(full, params))
    timed("work", work)

    def overlapped() -> None:
        pending = dist.all_reduce(full, async_op=True)
        work()
        pending.wait()
    timed("all_reduce_during_work", overlapped)
    default = collectives.PIECE_BYTES
    for kib in pieces_kib:  # the rings' message size (see [Note: gloo's collectives as rings])
        collectives.PIECE_BYTES = kib << 10
        timed(f"reduce_scatter_{kib}KiB", lambda: comm.reduce_scatter(own, full, "bucket"))
        timed(f"all_gather_{kib}KiB", lambda: comm.all_gather(full, params, "bucket"))
    collectives.PIECE_BYTES = default
    if pieces_kib:
        timed("all_reduce_again", lambda: dist.all_reduce(full))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=11_430_720, help="fp32 elements of one bucket")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/out/collectives.json")
    parser.add_argument("--pieces-kib", type=int, nargs="*", default=[],
                        help="also time the rings with messages of these sizes (KiB; default: PIECE_BYTES)")
    args = parser.parse_args()
    ranks = run_world(worker, 2, args=(args.elements, args.reps, args.pieces_kib), timeout=1800,
                      env={"OMP_NUM_THREADS": "1"})
    ms = {k: 1000 * max(r[k] for r in ranks) for k in ranks[0]}
    mb = args.elements * 4 / 1e6
    print(f"\none bucket of {args.elements:,} fp32 elements ({mb:.1f} MB), world 2 (gloo, 1 thread a rank), "
          f"median of {args.reps}, slowest rank\n")
    print("| collective | ms | x all_reduce |")
    print("| --- | --- | --- |")
    for name in ("all_reduce", "reduce_scatter", "all_gather", "reduce_scatter_tensor_form", "all_gather_tensor_form"):
        print(f"| {name} | {ms[name]:.1f} | {ms[name] / ms['all_reduce']:.2f} |")
    ddp = BUCKETS_91M * ms["all_reduce"]
    zero12 = BUCKETS_91M * (ms["reduce_scatter"] + ms["all_gather"])
    print(f"\nper step of the 91M model ({BUCKETS_91M} buckets): DDP {ddp:.0f} ms of collectives, "
          f"stages 1-2 {zero12:.0f} ms ({zero12 - ddp:+.0f} ms)")
    hidden = ms["work"] + ms["all_reduce"] - ms["all_reduce_during_work"]
    print(f"overlap: work {ms['work']:.1f} ms, all_reduce {ms['all_reduce']:.1f} ms, both "
          f"{ms['all_reduce_during_work']:.1f} ms: {hidden:.1f} ms of the collective hidden "
          f"({100 * hidden / ms['all_reduce']:.0f}%)")
    if args.pieces_kib:
        print(f"\nthe rings by message size (default {collectives.PIECE_BYTES >> 10} KiB); all_reduce measured "
              f"again after them: {ms['all_reduce_again']:.1f} ms\n")
        print("| message KiB | reduce_scatter ms | all_gather ms |")
        print("| --- | --- | --- |")
        for kib in args.pieces_kib:
            print(f"| {kib} | {ms[f'reduce_scatter_{kib}KiB']:.1f} | {ms[f'all_gather_{kib}KiB']:.1f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"elements": args.elements, "world": 2, "reps": args.reps, "ms": ms,
                               "per_step_ms": {"ddp": ddp, "stages_1_2": zero12},
                               "overlap_hidden_ms": hidden}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
