"""Muon against AdamW: step time, model-state bytes and the matrices' exchange bytes at every ZeRO stage.

    .venv/bin/python benchmarks/bench_muon.py [--size 91m] [--steps 8] [--warmup 2] [--stages 0 1 2 3]
        [--out benchmarks/out/muon.json]
    .venv/bin/python benchmarks/bench_muon.py --size tiny --steps 2 --warmup 0   # a smoke run

One world of two ranks per configuration: the demo GPT (``--size 91m``: vocabulary 8192, sequence 256,
width 768, 12 layers; ``30m``: width 512, 8 layers, the rest as 91m; ``tiny``: 4096, 64, 128, 2), fp32, ZeRO stages 0-3, with the config's
``AdamW`` and with its ``Muon`` (DeepSpeed's split; the token and position embeddings and the tied
head marked ``use_muon = False``, since their names hold neither ``embed`` nor ``lm_head``).  Per
configuration: the median step time of the measured steps (the slowest rank's), Muon's time over
AdamW's at the same stage, this rank's model-state bytes (``memory_breakdown()``) beside its formula,
and the ``all_to_all`` bytes each rank sent per step beside the count of [Note: whole matrices, each
on one rank] in zeroshard/optim/whole_matrices.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from all_to_all_steps import timed_steps  # noqa: E402
from zeroshard.tools.testing import run_world  # noqa: E402

SIZES = {"tiny": (4096, 64, 128, 2, 4), "30m": (8192, 256, 512, 8, 8), "91m": (8192, 256, 768, 12, 12)}
MICRO, WORLD = 4, 2
OPTIMIZERS = {"AdamW": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
              "Muon": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 3e-4, "weight_decay": 0.1}}}


def worker(rank: int, world: int, size: str, stage: int, optimizer: str, steps: int, warmup: int) -> dict[str, Any]:
    import torch

    import zeroshard
    from zeroshard.tools.demo.model import GPT, GPTConfig

    vocab, seq, width, layers, heads = SIZES[size]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, seq_len=seq, d_model=width, n_layer=layers, n_head=heads))
    for name, p in model.named_parameters():  # DeepSpeed's rule goes by name: mark the embeddings
        if name.startswith(("tok.", "pos.", "head.")):
            p.use_muon = False  # type: ignore[attr-defined]
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "optimizer": OPTIMIZERS[optimizer],
        "zero_optimization": {"stage": stage}, "steps_per_print": 10**9})
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("tok.", "pos.", "head.")))
    noted = noted_elements(engine.updater.matrices.plans, rank) * 4 if engine.updater.matrices else 0
    times, sent = timed_steps(engine, vocab, seq, MICRO, steps, warmup, seed=rank)
    memory = engine.memory_breakdown()
    engine.close()
    return {"times": times, "all_to_all": sent[-1], "matrices": matrices, "noted": noted,
            "model_states": memory["model_states"], "formula": memory["formula"]}


def noted_elements(plans: dict[int, Any], rank: int) -> int:
    """The note's count, from the layout and the owners: the elements ``rank`` sends per step (stages
    1-3: twice those it holds of others' matrices, once the parts of its own held elsewhere; stage 0:
    its own matrices to each other rank)."""
    sent = 0
    for plan in plans.values():
        n, c = plan.world_size, plan.chunk_numel
        for s in plan.bucket.slots:
            owner = plan.owners[s.index]
            if plan.whole:
                sent += s.numel * (n - 1) if owner == rank else 0
                continue
            held = [max(0, min((r + 1) * c, s.offset + s.numel) - max(r * c, s.offset)) for r in range(n)]
            sent += s.numel - held[owner] if owner == rank else 2 * held[rank]
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="91m")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "muon.json"))
    args = parser.parse_args()
    rows = []
    for stage in args.stages:
        for optimizer in OPTIMIZERS:
            ranks = run_world(worker, WORLD, args=(args.size, stage, optimizer, args.steps, args.warmup), timeout=3600)
            step = statistics.median(max(r["times"][i] for r in ranks) for i in range(args.steps))
            row = {"size": args.size, "stage": stage, "optimizer": optimizer, "step_s": step,
                   "model_states_mib": max(r["model_states"] for r in ranks) / 2**20,
                   "formula_mib": max(r["formula"] for r in ranks) / 2**20,
                   # the ranks own unequal shares of the matrices: the note counts the mean over the ranks
                   "all_to_all_mib": sum(r["all_to_all"] for r in ranks) / WORLD / 2**20,
                   "noted_mib": sum(r["noted"] for r in ranks) / WORLD / 2**20}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    adamw = {r["stage"]: r["step_s"] for r in rows if r["optimizer"] == "AdamW"}
    print("| stage | optimizer | step (s) | over AdamW | model states/rank (MiB) | formula (MiB) | "
          "all-to-all sent/step, mean of the ranks (MiB) | note's count (MiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['stage']} | {r['optimizer']} | {r['step_s']:.3f} | {r['step_s'] / adamw[r['stage']]:.2f} | "
              f"{r['model_states_mib']:.1f} | {r['formula_mib']:.1f} | {r['all_to_all_mib']:.2f} | "
              f"{r['noted_mib']:.2f} |")


if __name__ == "__main__":
    main()
