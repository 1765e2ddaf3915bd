"""Tensor parallelism (AutoTP) against data parallelism: step time, memory per rank, bytes sent.

    .venv/bin/python benchmarks/bench_tp.py [--steps 8] [--warmup 2] [--out benchmarks/out/tp.json]

One world of four ranks per configuration: a Hugging Face ``LlamaForCausalLM`` built from a
``LlamaConfig`` with random weights (hidden 512, intermediate 1376, 4 layers, 8 heads and 8
key/value heads, vocabulary 2048, untied head), sequence 128, micro batch 2, fp32, AdamW, ZeRO stage 3
and stage 1, each as tensor 2 x data 2 (``"tensor_parallel": {"autotp_size": 2}``) and as data 4.  The
ranks of a tensor-parallel group get the same batch (seeded by step and ``rank // T``).  Per
configuration: the median step time of the measured steps (the slowest rank's), this rank's
model-state bytes (``memory_breakdown()["model_states"]``) beside ``zeroshard estimate``'s, peak RSS,
and the bytes each rank sent per step by the engine's collectives (``engine.comm``: the data-parallel
group's).  DTensor's tensor-parallel all-reduces go through torch directly and are not in those
counters: one extra, untimed step under torch's ``CommDebugMode`` counts them (functional all-reduces),
reported beside the estimate's count and bytes (``planning.estimator.tensor_parallel_bytes``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zeroshard.tools.testing import run_world  # noqa: E402

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, MICRO, SEQ, WORLD = 2048, 512, 1376, 4, 8, 8, 2, 128, 4
CONFIGS = [(stage, tp) for stage in (3, 1) for tp in (2, 1)]


def build() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                        num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
                                        tie_word_embeddings=False))


def worker(rank: int, world: int, stage: int, tp: int, steps: int, warmup: int) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    import zeroshard

    model = build()
    params = sum(p.numel() for p in model.parameters())
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)

    def batch(step: int) -> torch.Tensor:  # the same on every rank of a tensor-parallel group
        seed = 1000 * step + rank // tp
        return torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(seed))

    def sent() -> int:
        return sum(c.bytes_sent for c in engine.comm.counters.values())

    times, per_step = [], []
    for step in range(warmup + steps):
        ids = batch(step)
        before = sent()
        start = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
            per_step.append(sent() - before)
    ids = batch(warmup + steps)  # one more step, untimed, counting DTensor's collectives
    with CommDebugMode() as comms:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    counts = {str(op): n for op, n in comms.get_comm_counts().items()}
    memory = engine.memory_breakdown()
    engine.close()
    return {"times": times, "sent": per_step[-1], "model_states": memory["model_states"], "params": params,
            "local_params": sum(p.numel() for p in model.parameters()),
            "tp_all_reduces": sum(n for op, n in counts.items() if op.endswith("all_reduce")), "comm_counts": counts,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def estimated(stage: int, tp: int, params: int) -> dict[str, float]:
    """``zeroshard estimate``'s model states per rank and tensor-parallel bytes per step for the configuration."""
    from zeroshard.planning.estimator import (EstimateRequest, ModelShape, TensorShape, estimate_stage,
                                              tensor_parallel_bytes)

    tensor = TensorShape(tp, kv_heads=KV_HEADS, ffn=FFN) if tp > 1 else None
    request = EstimateRequest(float(params), WORLD, precision="fp32", micro_batch=MICRO, seq_len=SEQ,
                              shape=ModelShape(hidden=HIDDEN, layers=LAYERS, heads=HEADS), tensor=tensor)
    per_layer = tensor_parallel_bytes(request) or 0.0
    reduces = (tensor.row_layers + tensor.column_layers) * LAYERS if tensor is not None else 0
    return {"model_states": estimate_stage(request, stage).model_states, "tp_bytes": per_layer * LAYERS,
            "tp_all_reduces": reduces}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "tp.json"))
    args = parser.parse_args()
    rows = []
    for stage, tp in CONFIGS:
        ranks = run_world(worker, WORLD, args=(stage, tp, args.steps, args.warmup), timeout=1800)
        step = statistics.median(max(r["times"][i] for r in ranks) for i in range(args.steps))
        estimate = estimated(stage, tp, ranks[0]["params"])
        row = {"stage": stage, "tp": tp, "dp": WORLD // tp, "step_s": step,
               "model_states_mib": max(r["model_states"] for r in ranks) / 2**20,
               "estimated_model_states_mib": estimate["model_states"] / 2**20,
               "local_params": ranks[0]["local_params"],
               "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
               "engine_sent_mib": max(r["sent"] for r in ranks) / 2**20,
               "tp_all_reduces": ranks[0]["tp_all_reduces"], "estimated_tp_all_reduces": estimate["tp_all_reduces"],
               "estimated_tp_sent_mib": estimate["tp_bytes"] / 2**20, "comm_counts": ranks[0]["comm_counts"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print("| stage | tensor x data | step (s) | model states/rank (MiB) | estimate (MiB) | peak RSS (MiB) | "
          "engine sent/rank/step (MiB) | TP all-reduces/step (counted, estimate) | TP sent/rank/step, estimate (MiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['stage']} | {r['tp']} x {r['dp']} | {r['step_s']:.3f} | {r['model_states_mib']:.1f} | "
              f"{r['estimated_model_states_mib']:.1f} | {r['peak_rss_mib']:.0f} | {r['engine_sent_mib']:.2f} | "
              f"{r['tp_all_reduces']}, {r['estimated_tp_all_reduces']} | {r['estimated_tp_sent_mib']:.2f} |")


if __name__ == "__main__":
    main()
