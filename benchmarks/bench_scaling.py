"""Stage 3 memory per rank as the world grows: an ~80M-parameter GPT at world sizes 2 and 4 (CPU, gloo).

    .venv/bin/python benchmarks/bench_scaling.py [--worlds 2 4] [--out benchmarks/out/scaling.json]

Model states per rank should fall as 1/N (16Ψ/N); peak RSS per rank falls with them, on top of the
process baseline (torch, gloo) and activations, which do not shrink.  ``zeroshard_3`` builds the model
whole on every rank first (so its peak includes one full copy); ``zeroshard_3_init`` builds it under
``zeroshard.Init``.  DDP at world 2 is the reference.
Same allocator policy as bench_stages.py (glibc thresholds pinned).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_stages import worker  # noqa: E402

from zeroshard.tools.testing import run_world  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/out/scaling.json")
    args = parser.parse_args()
    cfg = dict(vocab_size=256, seq_len=64, d_model=768, n_layer=11, n_head=12)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    os.environ["MALLOC_TRIM_THRESHOLD_"] = "131072"
    runs = [("ddp", 2)] + [(impl, n) for impl in ("zeroshard_3", "zeroshard_3_init") for n in args.worlds]
    results = []
    for impl, n in runs:
        ranks = run_world(worker, n, args=(impl, cfg, 1, args.steps, 1), timeout=1800)
        results.append({"impl": impl, "world": n, "params": ranks[0]["params"],
                        "model_state_mib": max(r["model_state_bytes"] for r in ranks) / 2**20,
                        "peak_rss_mib": max(r["peak_rss_bytes"] for r in ranks) / 2**20,
                        "median_step_s": max(r["median_step_s"] for r in ranks)})
        print(f"finished {impl} at world {n}", flush=True)
    psi = results[0]["params"]
    print(f"\nGPT {cfg}: {psi:,} parameters, fp32 AdamW, micro batch 1\n")
    print("| run | world | model states/rank (MiB) | 16Ψ/N (MiB) | peak RSS/rank (MiB) | step (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        formula = 16 * psi / (r["world"] if r["impl"] != "ddp" else 1) / 2**20
        print(f"| {r['impl']} | {r['world']} | {r['model_state_mib']:.1f} | {formula:.1f} | {r['peak_rss_mib']:.0f} | "
              f"{r['median_step_s']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": cfg, "results": results}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
