"""Step time against DDP and against the floor, interleaved: every implementation takes turns, step by step, in one world.

    .venv/bin/python benchmarks/bench_step_ratio.py                       # 91m fp32 and 23m bf16, stages 0-3
    .venv/bin/python benchmarks/bench_step_ratio.py --precision bf16      # 23m bf16 only (--size to choose)
    .venv/bin/python benchmarks/bench_step_ratio.py --world-per-stage     # less memory per rank (see below)
    .venv/bin/python benchmarks/bench_step_ratio.py --configs 91m:fp32 --stages 0 1 2 3 --rounds 8 --warmup 2
    .venv/bin/python benchmarks/bench_step_ratio.py --configs tiny:fp32 tiny:bf16 --rounds 3 --warmup 1 --profile
    .venv/bin/python benchmarks/bench_step_ratio.py --configs 91m:fp32 --stages 2 2_overlap   # overlap_param_gather
    python benchmarks/bench_step_ratio.py --device cuda --nproc 1 --configs 23m:bf16 --baselines ddp floor \
        --stages 0 2 --profile                                            # one GPU (scripts/gpu_check.sh)

bench_memory.py runs every implementation in a world of its own, one after the other; on a machine
whose speed drifts by 10-30% from minute to minute (the 2-core VM of benchmarks/RESULTS.md) a ratio of
two such runs says more about the minute than about the engine.  Here every implementation of a
configuration shares one world: the same processes (2 ranks x 1 thread, gloo, OMP_NUM_THREADS=1)
build each of them, from the same initial weights, and in each round every one takes one step on the
same batch, in an order that rotates from round to round, so that all of them see the same minute.
Everything else is bench_memory.py's: the GPT, the batches, torch's fused AdamW, DeepSpeed's default
``zero_optimization`` values, glibc's default allocator, and for ``bf16`` its precision settings.

The implementations:

* ``ddp``: torch's DDP (25 MB buckets; bf16 by autocast), gradients kept between steps;
* ``floor``: what no data-parallel implementation can go below: forward and backward of the same model
  on this rank's batch, then fused AdamW over this rank's 1/N of the parameters (a contiguous slice of
  one flat buffer the parameters are views of), with no communication at all (so the replicas drift
  apart: the floor is timed, not trained).  ``bf16``: bf16 parameters and gradients, the slice's fp32
  masters stepped and rounded back, as zeroshard's bf16 does;
* ``floor_comm``: the floor plus the bytes a sharded data-parallel step cannot avoid moving (its
  reduce-scatter and all-gather together: one all-reduce of the gradients, in ring arithmetic), moved by
  gloo's fastest collective, its all-reduce, in DDP's 25 MB buckets after backward, nothing overlapped
  (gloo's own reduce-scatter and all-gather of one flat buffer cost about three times its CPU: [Note:
  gloo's collectives as rings] in zeroshard/distributed/ring.py).  With one core per rank nothing hides
  the transport's CPU, so what ``floor_comm`` adds to the floor is its price on this machine;
* ``fsdp2``: ``fully_shard`` per block, then the root (bench_memory.py's);
* ``zeroshard_<s>`` for every ``--stages`` entry (or bench_memory.py's variants: ``2_overlap``, ...);
  ``3_chunkcopy``: stage 3 with every reduction in the bucket and the chunk copied out of it (without
  [Note: stage 3's first reduction lands in its chunk] in zeroshard/sharding/grad_chunks.py).

Per round, each step's time is its slowest rank's (a barrier before each step keeps one rank's tail out
of the next step).  Reported: each implementation's median step, and the medians over rounds of (its
step / DDP's step) and (its step / the floor's step) in the same round; also each step's process CPU
time (every thread of the rank: the training thread, gloo's and zeroshard's ring threads), averaged
over the ranks, which depends far less on the machine's load than the wall time does.

``--profile``: after the timed rounds, ``--profile-rounds`` more rounds with every implementation's
phases timed (benchmarks/step_phases.py: forward, backward compute, the waits on each kind of
collective, the copies into and out of buckets, the optimizer, host reads, the consistency check,
stage 3's gather rounds, ...), CPU (training thread) and wall milliseconds per step, written as a
table per configuration and into the JSON.  Sizes: ``tiny`` (1.9M) for a smoke test in seconds.

``--device cuda``: one rank per GPU (``--nproc``, at most the GPUs), NCCL, every implementation on the
rank's GPU; a world of one still communicates (DDP's all-reduce at one rank, zeroshard's
``collectives_in_a_world_of_one``, as ``zeroshard selftest --nproc 1``).  A timed step starts and ends
with the device synchronised (its time is then the device's too, the steps never overlap); a profiled
step is synchronised at every phase boundary as well (see [Note: phases on a device] in
benchmarks/step_phases.py).  On a GPU the training thread's CPU time includes autograd's thread for the
device (which runs backward there), and the process CPU time CUDA's and NCCL's threads.

Memory: each rank holds every implementation of its world at once; at 91M fp32 DDP and stage 0 hold
about 1.8 GB each (parameters, gradients, AdamW's two moments, buckets), the others 0.5-1.2 GB, about
9 GB per rank for all seven.  Where two ranks of that do not fit, ``--world-per-stage`` runs each stage
in a world of its own with the baselines beside it (every ratio still measured in one world).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_memory import ADAMW, SIZES, Step, batches, build  # noqa: E402
from step_phases import BOUNDARY_SYNCS, Installed, PhaseClock  # noqa: E402
from zeroshard.tools.demo.model import GPT, GPTConfig  # noqa: E402
from zeroshard.tools.testing import run_world  # noqa: E402

DDP_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default
BASELINES = ("ddp", "floor", "floor_comm", "fsdp2")
DEFAULT_SIZE = {"fp32": "91m", "bf16": "23m"}
OTHER_THREADS = "other threads of the rank (CPU only)"
TARGETS = {"zeroshard_0": ("ddp", 1.00), "zeroshard_1": ("floor", 1.05), "zeroshard_2": ("floor", 1.05),
           "zeroshard_3": ("floor", 1.05)}


def build_floor(model: GPT, rank: int, world: int, bf16: bool, communicate: bool = False) -> Step:
    """Forward, backward and fused AdamW over this rank's 1/N of the parameters; no communication.

    ``communicate`` (``floor_comm``): the same, plus the gradients all-reduced after backward in DDP's
    25 MB buckets, the bytes of a reduce-scatter and an all-gather together (see the module's docstring)."""
    if bf16:
        model.to(torch.bfloat16)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    shard = -(-numel // world)
    padded = shard * world  # every rank's slice the same length, as a reduce-scatter needs
    flat = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)  # 1D: every parameter a view
    grads = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset: offset + n].copy_(p.data.reshape(-1))
        p.data = flat[offset: offset + n].view_as(p)
        p.grad = grads[offset: offset + n].view_as(p)  # autograd accumulates into it in place
        offset += n
    start, end = rank * shard, (rank + 1) * shard
    bucket = DDP_BUCKET_BYTES // grads.element_size()
    if bf16:  # fp32 masters of the slice, rounded back into the bf16 parameters after the update
        owned = torch.nn.Parameter(flat[start:end].float())
        owned.grad = torch.empty_like(owned)
    else:
        owned = torch.nn.Parameter(flat[start:end])  # shares flat's storage: updated in place
        owned.grad = grads[start:end]
    opt = torch.optim.AdamW([owned], fused=True, **ADAMW)

    def step(x: torch.Tensor, y: torch.Tensor, mark: Callable[[str], None]) -> None:
        mark("forward")
        loss = model(x, y)
        mark("backward")
        loss.backward()
        if communicate:
            mark("all-reduce")
            for first in range(0, padded, bucket):
                torch.distributed.all_reduce(grads[first: first + bucket])
            grads[start:end].div_(world)
        mark("step")
        if bf16:
            assert owned.grad is not None
            owned.grad.copy_(grads[start:end])
        opt.step()
        if bf16:
            flat[start:end].copy_(owned.detach())
        grads.zero_()  # as DDP's zero_grad(set_to_none=False)
    return step


def build_impl(impl: str, cfg: GPTConfig, rank: int, world: int, micro: int, precision: str,
               device: torch.device) -> Step:
    torch.manual_seed(0)
    model = GPT(cfg)  # built on the CPU: the same initial weights on every device
    if device.type != "cpu":
        model.to(device)
    if impl in ("floor", "floor_comm"):
        return build_floor(model, rank, world, precision == "bf16", communicate=impl == "floor_comm")
    # a world of one issues the collectives of a larger one, as DDP does at one rank
    extra = {"collectives_in_a_world_of_one": True} if world == 1 else None
    step, _ = build(impl.removesuffix("_chunkcopy"), model, micro, precision, extra)
    if impl.endswith("_chunkcopy"):  # each bucket reduced in the bucket and its chunk copied out
        chunks = step.engine.strategy.grad_chunks  # type: ignore[attr-defined]
        chunks.reduce_into = lambda full, bucket: None
    return step


def rank_device(device_type: str) -> torch.device:
    """The rank's device: its GPU (run_world made it current, LOCAL_RANK's) or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def rank_batch(cfg: GPTConfig, rank: int, micro: int, i: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batches(cfg, rank, micro, i)
    return (x.to(device), y.to(device)) if device.type != "cpu" else (x, y)


def worker(rank: int, world: int, impls: list[str], cfg_dict: dict, micro: int, precision: str, rounds: int,
           warmup: int, profile_rounds: int, device_type: str = "cpu") -> dict:
    torch.set_num_threads(1)
    cfg = GPTConfig(**cfg_dict)
    device = rank_device(device_type)
    on_device = device.type == "cuda"
    steps = {impl: build_impl(impl, cfg, rank, world, micro, precision, device) for impl in impls}
    clock = PhaseClock(device)  # its threads' CPU: the training thread's (and on CUDA autograd's device thread's)
    wall: dict[str, list[float]] = {impl: [] for impl in impls}
    cpu: dict[str, list[float]] = {impl: [] for impl in impls}
    thread: dict[str, list[float]] = {impl: [] for impl in impls}
    for i in range(warmup + rounds):
        x, y = rank_batch(cfg, rank, micro, i, device)
        for impl in impls[i % len(impls):] + impls[:i % len(impls)]:  # every position in turn
            torch.distributed.barrier()  # the other rank's previous step does not leak into this one
            if on_device:  # the device idle when the step starts, and done with it when it is timed
                torch.cuda.synchronize(device)
            cpu0, thread0, start = time.process_time(), clock.threads_cpu(), time.perf_counter()
            steps[impl](x, y, lambda phase: None)
            if on_device:
                torch.cuda.synchronize(device)
            if i >= warmup:
                wall[impl].append(time.perf_counter() - start)
                cpu[impl].append(time.process_time() - cpu0)
                thread[impl].append(clock.threads_cpu() - thread0)
    phases: dict[str, Any] = {}
    if profile_rounds:
        patches = Installed(clock)
        try:
            for impl in impls:
                others = 0.0  # CPU of the rank's other threads (gloo's, the rings' progress threads)
                for i in range(profile_rounds):
                    x, y = rank_batch(cfg, rank, micro, warmup + rounds + i, device)
                    torch.distributed.barrier()
                    process0, thread0 = time.process_time(), clock.threads_cpu()
                    steps[impl](x, y, clock.mark)
                    clock.mark("")
                    others += (time.process_time() - process0) - (clock.threads_cpu() - thread0)
                phases[impl] = {p: {k: v / profile_rounds if k != "calls" else v // profile_rounds
                                    for k, v in r.items()} for p, r in clock.take().items()}
                phases[impl][OTHER_THREADS] = {"cpu_s": others / profile_rounds, "wall_s": 0.0, "calls": 0}
        finally:
            patches.remove()
    return {"wall": wall, "cpu": cpu, "thread": thread, "phases": phases}


def summarise(impls: list[str], ranks: list[dict], rounds: int) -> dict[str, dict]:
    wall = {impl: [max(r["wall"][impl][i] for r in ranks) for i in range(rounds)] for impl in impls}
    cpu = {impl: [statistics.mean(r["cpu"][impl][i] for r in ranks) for i in range(rounds)] for impl in impls}
    thread = {impl: [statistics.mean(r["thread"][impl][i] for r in ranks) for i in range(rounds)] for impl in impls}
    out: dict[str, dict] = {}
    for impl in impls:
        entry: dict[str, Any] = {"median_s": statistics.median(wall[impl]), "steps_s": wall[impl],
                                 "cpu_median_s": statistics.median(cpu[impl]), "cpu_s": cpu[impl],
                                 "thread_cpu_median_s": statistics.median(thread[impl]), "thread_cpu_s": thread[impl]}
        for base in ("ddp", "floor", "floor_comm"):
            if base in wall:
                ratios = [m / d for m, d in zip(wall[impl], wall[base])]
                cpu_ratios = [m / d for m, d in zip(cpu[impl], cpu[base])]
                entry[f"vs_{base}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                       "cpu_median": statistics.median(cpu_ratios)}
        out[impl] = entry
    return out


def print_table(results: dict[str, dict]) -> None:
    bases = [b for b in ("ddp", "floor", "floor_comm") if b in results]
    names = {"ddp": "DDP", "floor": "floor", "floor_comm": "floor + comm"}
    print("| implementation | median step s | " + " | ".join(f"/ {names[b]} (min-max)" for b in bases)
          + " | CPU s/step | " + " | ".join(f"CPU / {names[b]}" for b in bases) + " | training thread CPU s | target |")
    print("| --- |" + " --- |" * (2 * len(bases) + 4))
    for impl, r in results.items():
        cells = []
        for base in bases:
            v = r.get(f"vs_{base}")
            cells.append(f"{v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})" if v else "-")
        cpu_cells = [f"{r[f'vs_{b}']['cpu_median']:.3f}" if f"vs_{b}" in r else "-" for b in bases]
        target = TARGETS.get(impl)
        verdict = ""
        if target and f"vs_{target[0]}" in r:
            verdict = f"<= {target[1]:.2f} x {target[0]}: " + ("met" if r[f"vs_{target[0]}"]["median"] <= target[1]
                                                             else "not met")
        print(f"| {impl} | {r['median_s']:.3f} | " + " | ".join(cells) + f" | {r['cpu_median_s']:.3f} | "
              + " | ".join(cpu_cells) + f" | {r['thread_cpu_median_s']:.3f} | {verdict} |")


def merge_phases(ranks: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """Per implementation and phase: the mean over ranks of CPU and wall ms per step."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for impl in ranks[0]["phases"]:
        names = sorted({p for r in ranks for p in r["phases"][impl]})
        out[impl] = {p: {"cpu_ms": 1e3 * statistics.mean(r["phases"][impl].get(p, {}).get("cpu_s", 0.0) for r in ranks),
                         "wall_ms": 1e3 * statistics.mean(r["phases"][impl].get(p, {}).get("wall_s", 0.0) for r in ranks),
                         "calls": max(r["phases"][impl].get(p, {}).get("calls", 0) for r in ranks)}
                     for p in names}
    return out


def print_phases(phases: dict[str, dict[str, dict[str, float]]]) -> None:
    impls = list(phases)
    on_device = any(BOUNDARY_SYNCS in phases[i] for i in impls)
    order = "wall_ms" if on_device else "cpu_ms"  # on a device the wall carries the device's work
    names = sorted({p for impl in impls for p in phases[impl]},
                   key=lambda p: -max(phases[i].get(p, {}).get(order, 0.0) for i in impls))
    print("\nPer step, mean of the ranks: CPU ms of the training thread (wall ms) [calls]; each phase exclusive "
          "of those nested in it; forward / backward / step: what is left of them (compute)")
    if on_device:
        print("On the device: synchronised at every phase boundary, so a phase's wall includes the device work it "
              "queued (a collective's in its launch); host reads are the step's syncs; the training thread is "
              "the caller's and autograd's device thread (benchmarks/step_phases.py, [Note: phases on a device])")
    print()
    print("| phase | " + " | ".join(impls) + " |")
    print("| --- |" + " --- |" * len(impls))
    for p in names:
        cells = []
        for impl in impls:
            v = phases[impl].get(p)
            cells.append(f"{v['cpu_ms']:.1f} ({v['wall_ms']:.1f}) [{int(v['calls'])}]" if v else "")
        print(f"| {p} | " + " | ".join(cells) + " |")
    totals = [sum(v["cpu_ms"] for p, v in phases[i].items() if p != OTHER_THREADS) for i in impls]
    walls = [sum(v["wall_ms"] for v in phases[i].values()) for i in impls]
    print("| **training thread** | " + " | ".join(f"**{c:.1f}** ({w:.1f})" for c, w in zip(totals, walls)) + " |")
    print("| **process CPU** | " + " | ".join(f"**{c + phases[i][OTHER_THREADS]['cpu_ms']:.1f}**"
                                             for c, i in zip(totals, impls)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["91m:fp32", "23m:bf16"],
                        help="size:precision pairs, each in a world of its own (sizes: "
                             f"{', '.join(sorted(SIZES))}; precisions: fp32, bf16)")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="one configuration instead of --configs: this size at --precision")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                        help="one configuration instead of --configs: --size (default 91m for fp32, 23m for bf16)")
    parser.add_argument("--stages", nargs="+", default=["0", "1", "2", "3"],
                        help="stages, or bench_memory.py's variants of one: 1_overlap, 2_overlap, 3_trim, ...")
    parser.add_argument("--baselines", nargs="*", default=list(BASELINES), choices=BASELINES)
    parser.add_argument("--world-per-stage", action="store_true",
                        help="each stage in a world of its own, with the baselines beside it")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--rounds", "--pairs", type=int, default=8, help="measured rounds (one step of each implementation)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="also time each implementation's phases")
    parser.add_argument("--profile-rounds", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the ranks train: cpu (gloo) or cuda (NCCL, one GPU per rank)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of each world (on cuda at most the GPUs)")
    parser.add_argument("--out", default=None, help="default benchmarks/out/step_ratio_<configs>.json")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"--device cuda --nproc {args.nproc}: torch sees {torch.cuda.device_count()} CUDA "
                         f"device(s); one rank per GPU")
    if args.size or args.precision:
        precision = args.precision or "fp32"
        args.configs = [f"{args.size or DEFAULT_SIZE[precision]}:{precision}"]
    stages = [f"zeroshard_{s}" for s in args.stages]
    # one world for everything, or one per stage with the baselines beside it (memory: see the docstring)
    worlds = [list(args.baselines) + [stage] for stage in stages] if args.world_per_stage \
        else [list(args.baselines) + stages]
    report: dict[str, Any] = {"args": vars(args), "configs": {}}
    for config in args.configs:
        size, precision = config.split(":")
        cfg = SIZES[size]
        entries = []
        for impls in worlds:
            ranks = run_world(worker, args.nproc, args=(impls, cfg, args.micro_batch, precision, args.rounds,
                                                         args.warmup, args.profile_rounds if args.profile else 0,
                                                         args.device),
                              timeout=3600, env={"OMP_NUM_THREADS": "1"},
                              backend="nccl" if args.device == "cuda" else "gloo")
            results = summarise(impls, ranks, args.rounds)
            entry: dict[str, Any] = {"model": {**cfg, "params": GPTConfig(**cfg).num_params()}, "results": results}
            on = f" on {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
            print(f"\nGPT {size} ({GPTConfig(**cfg).num_params():,} parameters), {precision}, world {args.nproc}{on}, "
                  f"micro batch {args.micro_batch}, {args.rounds} rounds after {args.warmup}, order rotating\n")
            print_table(results)
            if args.profile:
                entry["phases"] = merge_phases(ranks)
                print_phases(entry["phases"])
            entries.append(entry)
        report["configs"][config] = entries[0] if len(entries) == 1 else {"worlds": entries}
    out = Path(args.out or f"benchmarks/out/step_ratio_{'_'.join(c.replace(':', '_') for c in args.configs)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
