"""The block quantiser's CPU cost (zeroshard/quantize/blocks.py) on the sizes ZeRO++ quantises per step for
the 91M GPT at stage 3 on a world of four (two nodes of two), against an earlier revision's quantiser.

    .venv/bin/python benchmarks/bench_quantiser.py [--before REV] [--repeats 15]
        [--out benchmarks/out/quantiser.json]

The chunks are the engine's: the 91M GPT's buckets as stage 3 plans them (``reduce_bucket_size`` 2e6 as in
bench_hybrid.py, world 4), in bf16 with blocks of 4096.  Per bucket and step (hpZ 2 + qwZ + qgZ 4-bit,
2 micro steps): qwZ packs this rank's bf16 chunk once (the first forward's gather over all ranks) and
unpacks the four ranks' chunks into the bf16 bucket; qgZ, at each micro step, packs the 2 chunks for its
node peer (bf16, 4 bits), unpacks the peer's 2 chunks and adds them to its fp32 sums, then packs the fp32
sum for the other node and unpacks and adds what that node sent.  Each operation is timed on one thread
(``time.thread_time``: the machine is shared) ``--repeats`` times, the two implementations interleaved
call by call, and the median is taken; the per-step figure is the medians times the calls a step makes.
``--before`` (default: the revision before the tiled quantiser) is read with ``git show``.  The two must
agree to the bit on every operation, which the script checks first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zeroshard.quantize import BlockFormat, blocks as after  # noqa: E402

BEFORE = "bc7be20"  # the last revision whose quantiser works on whole tensors
ACCUM, WORLD, NODES = 2, 4, 2
INT8, NIBBLES = BlockFormat(8, 4096), BlockFormat(4, 4096)


def load_before(rev: str) -> ModuleType:
    """``zeroshard/quantize/blocks.py`` as it was at ``rev``, as a module of this checkout's package."""
    source = subprocess.run(["git", "show", f"{rev}:zeroshard/quantize/blocks.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "blocks_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("zeroshard.quantize.blocks_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "zeroshard.quantize"
    spec.loader.exec_module(module)
    return module


def shard_sizes() -> list[int]:
    """This rank's chunk of each of the 91M GPT's stage-3 buckets on a world of four."""
    from zeroshard.sharding.layout import capped_bucket_numel, plan_buckets
    from zeroshard.tools.demo.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=8192, seq_len=128, d_model=768, n_layer=12, n_head=12))
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    bucket = capped_bucket_numel(2_000_000, sum(p.numel() for p in params), 8)
    return [b.shard_numel for b in plan_buckets(params, names, [0] * len(params), bucket, WORLD).buckets]


@dataclass
class Operation:
    """One call the engine makes, ``per_step`` times a step per bucket; ``run(module)`` returns its result."""

    name: str
    per_step: int
    run: Callable[[ModuleType], torch.Tensor]


def operations(shard: int) -> list[Operation]:
    g = torch.Generator().manual_seed(shard)
    weights = torch.randn(shard, generator=g).to(torch.bfloat16)
    bucket = torch.empty(WORLD * shard, dtype=torch.bfloat16)
    packed_weights = after.pack(weights, INT8)
    grads = (torch.randn(NODES * shard, generator=g) * 1e-3).to(torch.bfloat16)  # the peer's M chunks
    packed_grads = after.pack(grads, NIBBLES)
    node_sum = torch.randn(shard, generator=g) * 1e-3
    packed_sum = after.pack(node_sum, NIBBLES)
    sums = torch.randn(NODES * shard, generator=g)
    into = torch.empty_like(sums)

    def unpack_all(m: ModuleType) -> torch.Tensor:
        for rank in range(WORLD):
            m.unpack(packed_weights, shard, INT8, bucket[rank * shard:(rank + 1) * shard])
        return bucket

    def add(m: ModuleType, packed: torch.Tensor, numel: int) -> torch.Tensor:
        out = into[:numel]
        out.copy_(sums[:numel])
        if m is after:
            return m.unpack(packed, numel, NIBBLES, out, accumulate=True)
        out += m.unpack(packed, numel, NIBBLES)
        return out

    return [Operation("qwZ pack (bf16 chunk, int8)", 1, lambda m: m.pack(weights, INT8)),
            Operation("qwZ unpack x4 (into bf16)", 1, unpack_all),
            Operation("qgZ inside pack (bf16, 2 chunks, 4-bit)", ACCUM, lambda m: m.pack(grads, NIBBLES)),
            Operation("qgZ inside unpack + add (fp32)", ACCUM, lambda m: add(m, packed_grads, NODES * shard)),
            Operation("qgZ across pack (fp32 chunk, 4-bit)", ACCUM, lambda m: m.pack(node_sum, NIBBLES)),
            Operation("qgZ across unpack + add (fp32)", ACCUM, lambda m: add(m, packed_sum, shard))]


def seconds(call: Callable[[], object]) -> float:
    start = time.thread_time()
    call()
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "quantiser.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each rank of a world of four on this CPU
    before = load_before(args.before)
    sizes = shard_sizes()
    counts = {size: sizes.count(size) for size in sorted(set(sizes))}
    rows: dict[str, dict[str, float]] = {}
    for size, buckets in counts.items():
        for op in operations(size):
            a = op.run(before).clone()  # the buffers written are shared
            b = op.run(after)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{op.name}, {size}: not bit for bit"
            times: dict[str, list[float]] = {"before": [], "after": []}
            for _ in range(args.repeats):
                times["before"].append(seconds(lambda: op.run(before)))
                times["after"].append(seconds(lambda: op.run(after)))
            row = rows.setdefault(op.name, {"before_s": 0.0, "after_s": 0.0})
            for key in ("before", "after"):
                median = statistics.median(times[key])
                row[f"{key}_s"] += median * op.per_step * buckets
                row[f"{key}_ms_{size}"] = median * 1e3
    total = {k: sum(r[f"{k}_s"] for r in rows.values()) for k in ("before", "after")}
    print(f"91M GPT, stage 3 on 4 ranks: {len(sizes)} buckets, chunks {counts}; bf16, blocks of 4096; "
          f"one thread, median of {args.repeats}, before = {args.before}\n")
    print("| operation (per bucket) | calls / step | " + " | ".join(f"ms before / after ({s:,})" for s in counts)
          + " | s / step before | s / step after | speed-up |")
    print("| --- " * (5 + len(counts)) + "|")
    for name, row in rows.items():
        per_step = next(op.per_step for op in operations(1) if op.name == name)
        cells = " | ".join(f"{row[f'before_ms_{s}']:.2f} / {row[f'after_ms_{s}']:.2f}" for s in counts)
        print(f"| {name} | {per_step} | {cells} | {row['before_s']:.3f} | {row['after_s']:.3f} | "
              f"{row['before_s'] / row['after_s']:.1f}x |")
    print(f"| **all, per step** | | {' | '.join('' for _ in counts)} | {total['before']:.3f} | {total['after']:.3f} | "
          f"{total['before'] / total['after']:.1f}x |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"before": args.before, "sizes": counts, "rows": rows, "total_s": total},
                                         indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
