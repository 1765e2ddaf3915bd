"""Sequence parallelism at long sequences: memory per rank, the longest sequence under a memory cap,
Ulysses against the ring, and the exchange bytes against ``zeroshard estimate``.

    .venv/bin/python benchmarks/bench_sequence.py [--seq-len 16384] [--longest 2.0 2.5 3.0]
        [--speed-seq-len 4096] [--rounds 3] [--out benchmarks/out/sequence.json]

A small Llama-style decoder (zeroshard's own: token embeddings, rotary-free learned positions, blocks of
causal attention through ``DistributedAttention`` over torch's ``scaled_dot_product_attention`` and an
MLP, a head) in fp32, world 2 (gloo, one thread a rank), one sequence per step, SGD, ZeRO-1, with
``host_memory_release`` (glibc returns each freed block over 1 MiB at once, so the RSS high-water mark
follows the tensors alive rather than the allocator's retained heap).
- **Memory**: each configuration in fresh processes; a rank's activation peak is its RSS high-water
  mark over two training steps less its RSS once the engine is built, beside ``zeroshard estimate
  --flash-attention``'s activations (torch's attention runs its fused kernel here: no s x s scores;
  planning/estimator.py: [Note: sequence parallel estimates]) and the bytes the second step's forward
  leaves saved for backward (``engine.measure_activations()``).  Sequence 1 x data 2 (each
  rank one whole sequence) against sequence 2 x data 1 (each rank half of one).
- **Longest sequence under a cap**: the cap is sequence 1's peak at ``--seq-len``; sequence 2 (Ulysses)
  trains ``--longest`` multiples of that length in turn, the longest whose peak stays under the cap
  is reported (target: >= 1.8x).
- **Ulysses against the ring**: sequence 2 x data 1 at ``--speed-seq-len``, the two modes in the same
  processes, alternating rounds of steps; tokens per second of each, and the bytes the ledger counted
  per step beside the estimate's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zeroshard  # noqa: E402
from zeroshard.host.process_memory import host_peak_bytes, proc_bytes  # noqa: E402
from zeroshard.planning.estimator import (EstimateRequest, ModelShape, SequenceShape, activation_bytes,  # noqa: E402
                                          sequence_exchange_bytes)
from zeroshard.sequence import DistributedAttention, sequence_positions  # noqa: E402
from zeroshard.tools.testing import run_world  # noqa: E402

VOCAB, D, HEADS, LAYERS = 512, 128, 4, 2
MiB = 2 ** 20


class LocalAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.out = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        self.attention = DistributedAttention(LocalAttention(), None, scatter_idx=2, gather_idx=1)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, D // HEADS) for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        x = x + self.out(self.attention(q, k, v).reshape(b, s, D))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, D), nn.Embedding(max_len, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def engine_for(sp: int, seq_len: int, mode: str = "ulysses") -> Any:
    torch.manual_seed(0)
    return zeroshard.initialize(model=Decoder(seq_len), config={
        "train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": sp, "steps_per_print": 10 ** 9,
        "sequence_parallel": {"mode": mode}, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1}, "host_memory_release": True})[0]


def train_step(engine: Any, seq_len: int, step: int) -> None:
    dims = engine.parallel_dims
    where = dims.coords(torch.distributed.get_rank())
    g = torch.Generator().manual_seed(100 * step + where.data)
    tokens, labels = torch.randint(0, VOCAB, (2, 1, seq_len), generator=g)
    part = sequence_positions(seq_len, where.seq, dims.sp)
    engine.backward(engine(tokens[:, part], part.unsqueeze(0), labels[:, part]))
    engine.step()


def memory_worker(rank: int, world: int, sp: int, seq_len: int) -> dict[str, float]:
    torch.set_num_threads(1)
    engine = engine_for(sp, seq_len)
    built = proc_bytes("/proc/self/status", "VmRSS") or 0
    with open("/proc/self/clear_refs", "w") as f:  # the high-water mark from here on
        f.write("5")
    start = time.perf_counter()
    train_step(engine, seq_len, 0)
    with engine.measure_activations():  # the second step's forward: what it leaves saved for backward
        train_step(engine, seq_len, 1)
    elapsed = time.perf_counter() - start
    saved = engine.memory_breakdown()["activations"]
    engine.close()
    return {"activation_peak": host_peak_bytes() - built, "built": built, "seconds": elapsed, "saved": saved}


def estimate(sp: int, seq_len: int, mode: str = "ulysses") -> EstimateRequest:
    return EstimateRequest(num_params=1, world_size=2, precision="fp32", micro_batch=1, seq_len=seq_len,
                           shape=ModelShape(hidden=D, layers=LAYERS, heads=HEADS), flash_attention=True,
                           sequence=SequenceShape(sp, mode) if sp > 1 else None)


def measure(sp: int, seq_len: int) -> dict[str, float]:
    ranks = run_world(memory_worker, 2, args=(sp, seq_len), timeout=3600, env={"OMP_NUM_THREADS": "1"})
    peak, saved = max(r["activation_peak"] for r in ranks), max(r["saved"] for r in ranks)
    print(f"  sequence {sp} x data {2 // sp}, {seq_len} tokens: activation peak {peak / MiB:.0f} MiB a rank, "
          f"saved for backward {saved / MiB:.1f} MiB (estimate {activation_bytes(estimate(sp, seq_len)) / MiB:.0f} "
          f"MiB), {max(r['seconds'] for r in ranks):.1f} s for 2 steps", flush=True)
    return {"sp": sp, "seq_len": seq_len, "activation_peak": peak, "saved": saved,
            "estimate": activation_bytes(estimate(sp, seq_len)), "seconds": max(r["seconds"] for r in ranks)}


def speed_worker(rank: int, world: int, seq_len: int, rounds: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"ulysses": [], "ring": []}
    sent: dict[str, float] = {}
    for r in range(rounds):
        for mode in (("ulysses", "ring") if r % 2 == 0 else ("ring", "ulysses")):
            engine = engine_for(2, seq_len, mode)
            train_step(engine, seq_len, 0)  # warm-up
            log = engine.comm.ledger.start_log()
            torch.distributed.barrier()
            start = time.perf_counter()
            for step in range(1, steps + 1):
                train_step(engine, seq_len, step)
            torch.distributed.barrier()
            times[mode].append((time.perf_counter() - start) / steps)
            sent[mode] = sum(x.sent for x in log if x.label.startswith("sequence_")) / steps
            engine.close()
    return {"times": times, "sent": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--longest", type=float, nargs="+", default=[2.0, 2.5, 3.0])
    parser.add_argument("--speed-seq-len", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--skip", nargs="*", default=[], choices=["memory", "longest", "speed"])
    parser.add_argument("--out", default="benchmarks/out/sequence.json")
    args = parser.parse_args()
    results: dict[str, Any] = {"model": {"vocab": VOCAB, "d_model": D, "heads": HEADS, "layers": LAYERS}}
    if "memory" not in args.skip or "longest" not in args.skip:
        print(f"memory at {args.seq_len} tokens:", flush=True)
        results["memory"] = [measure(sp, args.seq_len) for sp in (1, 2)]
    if "longest" not in args.skip:
        cap = results["memory"][0]["activation_peak"]
        print(f"longest sequence at sequence 2 under sequence 1's peak at {args.seq_len} ({cap / MiB:.0f} MiB):")
        tried = []
        for factor in args.longest:
            row = measure(2, int(args.seq_len * factor) // 2 * 2)
            row["fits"] = row["activation_peak"] <= cap
            tried.append(row)
            if not row["fits"]:
                break
        fitting = [r["seq_len"] for r in tried if r["fits"]]
        results["longest"] = {"cap": cap, "tried": tried,
                              "ratio": (max(fitting) / args.seq_len) if fitting else 1.0}
        print(f"  longest that fits: {max(fitting) if fitting else args.seq_len} tokens, "
              f"{results['longest']['ratio']:.2f}x sequence 1's", flush=True)
    if "speed" not in args.skip:
        ranks = run_world(speed_worker, 2, args=(args.speed_seq_len, args.rounds, args.steps), timeout=3600,
                          env={"OMP_NUM_THREADS": "1"})
        speed = {}
        for mode in ("ulysses", "ring"):
            step = statistics.median(max(r["times"][mode][i] for r in ranks) for i in range(args.rounds))
            expected = LAYERS * sequence_exchange_bytes(estimate(2, args.speed_seq_len, mode))
            speed[mode] = {"step_s": step, "tokens_per_s": args.speed_seq_len / step,
                           "sent_per_step": ranks[0]["sent"][mode], "estimate_per_step": expected}
            print(f"{mode}: {args.speed_seq_len / step:.0f} tokens/s ({step:.2f} s a step), "
                  f"{ranks[0]['sent'][mode] / MiB:.2f} MiB sent a step by rank 0 (estimate "
                  f"{expected / MiB:.2f} MiB)", flush=True)
        results["speed"] = speed
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
