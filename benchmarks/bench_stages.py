"""DDP, torch's ZeroRedundancyOptimizer and FSDP2 vs zeroshard stages 0-3, on CPU (gloo).

    .venv/bin/python benchmarks/bench_stages.py [--layers 11] [--steps 12] [--out benchmarks/out/stages.json]

Each implementation runs in a fresh world of spawned processes (one intra-op thread per rank, the
same allocator settings for all), trains the same GPT on the same batches, and reports the median
step time, its ratio to DDP's, peak RSS per rank, model-state bytes per rank, and bytes each rank
sent per step.  zeroshard's bytes come from its collectives layer; for the torch implementations they
are computed with the same ring model (see zeroshard/distributed/collectives.py [Note: byte model]).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zeroshard  # noqa: E402
from zeroshard.tools.demo.model import GPT, GPTConfig  # noqa: E402
from zeroshard.tools.testing import run_world  # noqa: E402

IMPLEMENTATIONS = ["ddp", "torch_zero", "fsdp2", "zeroshard_0", "zeroshard_1", "zeroshard_2", "zeroshard_3"]
# Stage 3 as FSDP2 runs by default: every block released after its forward (no reuse window), the
# next block prefetched (about one block: 2M elements); biases and norms (<= 1e5 elements) persistent, as DeepSpeed's default.
STAGE3 = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 2_000_000}
LR = 1e-4
BUCKET_ELEMENTS = 6_250_000  # 25 MB of fp32, DDP's default bucket size


def batches(cfg: GPTConfig, rank: int, micro: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    data = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def state_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(state_bytes(v for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
               for s in opt.state.values())


def worker(rank: int, world: int, impl: str, cfg_dict: dict, micro: int, steps: int, warmup: int) -> dict:
    cfg = GPTConfig(**cfg_dict)
    torch.manual_seed(0)
    if impl.endswith("_init"):  # built already sharded: the full model never exists on one rank
        with zeroshard.Init():
            model = GPT(cfg)
        impl = impl[: -len("_init")]
    else:
        model = GPT(cfg)
    psi = sum(p.numel() for p in model.parameters())
    if impl.startswith("zeroshard"):
        stage = int(impl[-1])
        engine, _, _, _ = zeroshard.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET_ELEMENTS,
                                  "allgather_bucket_size": 4 * BUCKET_ELEMENTS, **(STAGE3 if stage == 3 else {})}})

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            engine.backward(engine(x, y))
            engine.step()
    elif impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    else:
        ddp = DDP(model, bucket_cap_mb=25)
        if impl == "ddp":
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        else:
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            ddp(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    times = []
    for i in range(warmup + steps):
        x, y = batches(cfg, rank, micro, i)
        if i == warmup and impl.startswith("zeroshard"):
            engine.comm.reset_counters()
        start = time.perf_counter()
        step(x, y)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    n = world
    if impl.startswith("zeroshard"):
        mb = engine.memory_breakdown()
        model_states = mb["model_states"]
        sent = engine.comm.total_bytes_sent() / steps
    elif impl == "fsdp2":
        local = [p.to_local() for p in model.parameters()]  # type: ignore[attr-defined]
        opt_bytes = sum(state_bytes(v.to_local() if hasattr(v, "to_local") else v
                                    for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
                        for s in opt.state.values())
        model_states = 2 * state_bytes(local) + opt_bytes  # zero_grad() frees grads: count them as params
        sent = 3 * (n - 1) * 4 * psi // n  # all-gather in forward and backward, reduce-scatter
    else:
        grads = state_bytes(p.grad for p in model.parameters() if p.grad is not None)
        opt_bytes = optimizer_state_bytes(opt.optim if impl == "torch_zero" else opt)  # type: ignore[attr-defined]
        model_states = state_bytes(model.parameters()) + grads + opt_bytes
        all_reduce = 2 * (n - 1) * 4 * psi // n
        sent = all_reduce + ((n - 1) * 4 * psi // n if impl == "torch_zero" else 0)
    return {"median_step_s": statistics.median(times), "peak_rss_bytes": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024, "model_state_bytes": model_states, "bytes_sent_per_step": sent,
        "params": psi}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=11)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=IMPLEMENTATIONS)
    parser.add_argument("--allocator", choices=["fixed", "default"], default="fixed",
                        help="fixed: glibc mmap/trim thresholds pinned at 128 KiB for every run (default)")
    parser.add_argument("--out", default="benchmarks/out/stages.json")
    args = parser.parse_args()
    cfg = dict(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_layer=args.layers,
               n_head=args.d_model // 64)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.allocator == "fixed":
        # One allocator policy for every implementation: blocks above 128 KiB are always mmapped and
        # returned on free, so peak RSS follows live memory instead of glibc's adaptive threshold.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
        os.environ["MALLOC_TRIM_THRESHOLD_"] = "131072"
    results = {}
    for impl in args.only:
        ranks = run_world(worker, 2, args=(impl, cfg, args.micro_batch, args.steps, args.warmup), timeout=1800)
        results[impl] = {
            "median_step_s": max(r["median_step_s"] for r in ranks),
            "peak_rss_mib_per_rank": [r["peak_rss_bytes"] / 2**20 for r in ranks],
            "model_state_mib_per_rank": [r["model_state_bytes"] / 2**20 for r in ranks],
            "mib_sent_per_step_per_rank": [r["bytes_sent_per_step"] / 2**20 for r in ranks],
            "params": ranks[0]["params"],
        }
        print(f"finished {impl}", flush=True)
    base = results.get("ddp", {}).get("median_step_s")
    print(f"\nGPT {cfg}, {next(iter(results.values()))['params']:,} parameters, world 2, fp32, micro batch "
          f"{args.micro_batch}, median of {args.steps} steps, allocator {args.allocator}\n")
    print(f"| {'implementation':<14} | step (s) | vs DDP | peak RSS/rank (MiB) | model states/rank (MiB) | sent/step/rank (MiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for impl, r in results.items():
        ratio = f"{r['median_step_s'] / base:.3f}" if base else "-"
        print(f"| {impl:<14} | {r['median_step_s']:.3f} | {ratio} | {max(r['peak_rss_mib_per_rank']):.0f} | "
              f"{max(r['model_state_mib_per_rank']):.1f} | {max(r['mib_sent_per_step_per_rank']):.1f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": cfg, "args": vars(args), "results": results}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
