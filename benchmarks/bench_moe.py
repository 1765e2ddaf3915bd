"""Expert parallelism against data-parallel experts: step time, memory per rank, all-to-all bytes.

    .venv/bin/python benchmarks/bench_moe.py [--steps 8] [--warmup 2] [--out benchmarks/out/moe.json]

One world of four ranks per configuration: a stack of MoE layers (DeepSpeed's ``MoE``, 8 experts of
a two-layer MLP each, top-2, capacity factor 1) between a token embedding and a head, fp32, AdamW,
ZeRO stage 2 and 3, ``ep_size`` 1 (every expert on every rank, sharded by ZeRO like any parameter),
2 (ep 2 x data 2) and 4 (one rank per pair of experts, data 1).  Per configuration: the median step
time of the measured steps (the slowest rank's), this rank's model-state bytes (``memory_breakdown()``:
all, and the experts' part), peak RSS, and the bytes each rank sent by all-to-all per step beside
``zeroshard estimate``'s formula for them (``planning.estimator.all_to_all_bytes``).
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from all_to_all_steps import timed_steps  # noqa: E402
from zeroshard.tools.testing import run_world  # noqa: E402

VOCAB, HIDDEN, FFN, EXPERTS, LAYERS, MICRO, SEQ, TOPK = 512, 256, 1024, 8, 4, 8, 64, 2
CONFIGS = [(stage, ep) for stage in (2, 3) for ep in (1, 2, 4)]


def worker(rank: int, world: int, stage: int, ep: int, steps: int, warmup: int) -> dict[str, Any]:
    import torch
    from torch import nn

    import zeroshard
    from zeroshard.experts import MoE
    from zeroshard.moe.utils import split_params_into_different_moe_groups_for_optimizer

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.layers = nn.ModuleList(
                MoE(HIDDEN, nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN)),
                    num_experts=EXPERTS, ep_size=ep, k=TOPK) for _ in range(LAYERS))
            self.head = nn.Linear(HIDDEN, VOCAB)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h, aux = self.embed(x), 0.0
            for layer in self.layers:
                out, l_aux, _ = layer(h)
                h, aux = h + out, aux + l_aux
            return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten()) + 0.01 * aux

    torch.manual_seed(0)
    model = Model()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters())})
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=groups, config={
        "train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage}, "steps_per_print": 10**9})
    times, sent = timed_steps(engine, VOCAB, SEQ, MICRO, steps, warmup, seed=rank)
    memory = engine.memory_breakdown()
    engine.close()
    return {"times": times, "all_to_all": sent[-1], "model_states": memory["model_states"],
            "expert_model_states": memory.get("expert_model_states", None),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def estimated_all_to_all(ep: int) -> float:
    from zeroshard.planning.estimator import EstimateRequest, ModelShape, MoEShape, all_to_all_bytes

    moe = MoEShape(EXPERTS, 2 * HIDDEN * FFN + HIDDEN + FFN, LAYERS, ep_size=ep, topk=TOPK)
    request = EstimateRequest(1.0, 4, precision="fp32", micro_batch=MICRO, seq_len=SEQ,
                              shape=ModelShape(hidden=HIDDEN), moe=moe)
    per_layer = all_to_all_bytes(request)
    assert per_layer is not None
    return per_layer * LAYERS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "moe.json"))
    args = parser.parse_args()
    rows = []
    for stage, ep in CONFIGS:
        ranks = run_world(worker, 4, args=(stage, ep, args.steps, args.warmup), timeout=1800)
        step = statistics.median(max(r["times"][i] for r in ranks) for i in range(args.steps))
        row = {"stage": stage, "ep": ep, "step_s": step,
               "model_states_mib": max(r["model_states"] for r in ranks) / 2**20,
               "expert_states_mib": (max(r["expert_model_states"] for r in ranks) / 2**20
                                     if ranks[0]["expert_model_states"] is not None else None),
               "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
               "all_to_all_mib": ranks[0]["all_to_all"] / 2**20,
               "estimated_all_to_all_mib": estimated_all_to_all(ep) / 2**20}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print("| stage | ep x data | step (s) | model states/rank (MiB) | of which experts | peak RSS (MiB) | "
          "all-to-all sent/rank/step (MiB) | estimate (MiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        experts = f"{r['expert_states_mib']:.1f}" if r["expert_states_mib"] is not None else "(all ranks hold all)"
        print(f"| {r['stage']} | {r['ep']} x {4 // r['ep']} | {r['step_s']:.3f} | {r['model_states_mib']:.1f} | "
              f"{experts} | {r['peak_rss_mib']:.0f} | {r['all_to_all_mib']:.2f} | {r['estimated_all_to_all_mib']:.2f} |")


if __name__ == "__main__":
    main()
