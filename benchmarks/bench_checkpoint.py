"""Checkpoint save and load: zeroshard's sharded format against ``torch.save`` of the full state.

    .venv/bin/python benchmarks/bench_checkpoint.py [--stage 2] [--out benchmarks/out/checkpoint.json]

The ~20M GPT of bench_stages.py at world size 2 on CPU, after one AdamW step.  zeroshard: every rank
writes its shard (with CRC-32 checksums) and rank 0 the manifest; load verifies every checksum and
reads back each rank's share.  Baseline: rank 0 ``torch.save``s the full model and optimizer state
dicts (what a DDP job writes) and ``torch.load``s them.  Times are the slowest rank's, median of 3.
"""

from __future__ import annotations

import argparse
import json
import shutil
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
from zeroshard.tools.testing import run_world  # noqa: E402

CFG = GPTConfig(vocab_size=256, seq_len=128, d_model=384, n_layer=11, n_head=6)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def worker(rank: int, world: int, stage: int, directory: str, repeats: int) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 6_250_000}})
    x = torch.randint(0, 256, (2, CFG.seq_len))
    engine.backward(engine(x, x))
    engine.step()
    root = Path(directory)
    saves, loads, torch_saves, torch_loads = [], [], [], []
    for i in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(root / "zs", tag=f"t{i}")
        saves.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        engine.load_checkpoint(root / "zs", tag=f"t{i}")
        loads.append(time.perf_counter() - start)
        # Baseline: the full state on rank 0 (a DDP job's checkpoint), written and read back.
        dist.barrier()
        start = time.perf_counter()
        full = engine.full_state_dict()
        if rank == 0:
            torch.save({"model": full, "optimizer": _full_optimizer_state(engine)}, root / f"torch{i}.pt")
        dist.barrier()
        torch_saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        if rank == 0:
            torch.load(root / f"torch{i}.pt")
        dist.barrier()
        torch_loads.append(time.perf_counter() - start)
    return {"save": statistics.median(saves), "load": statistics.median(loads),
            "torch_save": statistics.median(torch_saves), "torch_load": statistics.median(torch_loads)}


def _full_optimizer_state(engine: zeroshard.Engine) -> dict:
    # Moments of the size of the model, as torch.optim.AdamW would hold them on every DDP rank.
    return {"exp_avg": torch.zeros(engine.storage.layout.numel), "exp_avg_sq": torch.zeros(engine.storage.layout.numel)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/out/checkpoint.json")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="zs-bench-ckpt-"))
    try:
        ranks = run_world(worker, 2, args=(args.stage, str(directory), args.repeats), timeout=1800)
        zs_bytes = dir_bytes(directory / "zs" / "t0")
        torch_bytes = (directory / "torch0.pt").stat().st_size
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result = {k: max(r[k] for r in ranks) for k in ranks[0]}
    result.update(zeroshard_bytes=zs_bytes, torch_bytes=torch_bytes, stage=args.stage)
    print(f"\nGPT {CFG.num_params():,} parameters, AdamW, world 2, ZeRO stage {args.stage}, median of {args.repeats}\n")
    print("| format | save (s) | load (s) | bytes written |")
    print("| --- | --- | --- | --- |")
    print(f"| zeroshard sharded (checksummed) | {result['save']:.3f} | {result['load']:.3f} | {zs_bytes:,} |")
    print(f"| torch.save of the full state (rank 0) | {result['torch_save']:.3f} | {result['torch_load']:.3f} | "
          f"{torch_bytes:,} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
