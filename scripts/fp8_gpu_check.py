"""FP8 against bf16 on one GPU: tokens/s of a GPT trained by one process with and without FP8 layers, and
the FP8 run's loss beside bf16's (scripts/gpu_check.sh runs it).

    python scripts/fp8_gpu_check.py [--steps 20] [--json out.json]

Skipped, with exit status 0, where FP8 training cannot run: torchao not installed, no CUDA device, or a
GPU without FP8 GEMMs (compute capability below 8.9).  Otherwise both runs start from the same weights
and see the same batches; the check fails when the FP8 run's mean loss over the last five steps is more
than 5% above bf16's (a layer gone wrong diverges far beyond that).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zeroshard  # noqa: E402
from zeroshard.tools.demo.model import GPT, GPTConfig  # noqa: E402

MODEL = dict(vocab_size=256, seq_len=1024, d_model=2048, n_layer=8, n_head=16)


def skip_reason() -> str | None:
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() < (8, 9):
        return f"{torch.cuda.get_device_name()} has no FP8 GEMMs (compute capability below 8.9)"
    return None


def train(fp8: bool, steps: int, micro: int) -> dict:
    cfg = GPTConfig(**MODEL)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    config = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 0}, "fp8": {"enabled": fp8}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(steps):
        data = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1), generator=g).cuda()
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = engine(data[:, :-1], data[:, 1:])
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    engine.close()
    step_s = statistics.median(times[2:] or times)
    return {"tokens_per_s": micro * cfg.seq_len / step_s, "median_step_s": step_s, "losses": losses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    reason = skip_reason()
    if reason is not None:
        print(f"fp8: skipped ({reason})")
        return 0
    runs = {"bf16": train(False, args.steps, args.micro_batch), "fp8": train(True, args.steps, args.micro_batch)}
    tail = {name: statistics.mean(run["losses"][-5:]) for name, run in runs.items()}
    speedup = runs["fp8"]["tokens_per_s"] / runs["bf16"]["tokens_per_s"]
    print(f"GPT {MODEL} on {torch.cuda.get_device_name()}, micro batch {args.micro_batch}, {args.steps} steps")
    for name, run in runs.items():
        print(f"{name}: {run['tokens_per_s']:,.0f} tokens/s, median step {run['median_step_s']:.4f} s, "
              f"last-5 loss {tail[name]:.4f}")
    print(f"fp8 / bf16 tokens/s: {speedup:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": MODEL, "runs": runs, "speedup": speedup}, indent=1))
    ok = tail["fp8"] <= 1.05 * tail["bf16"]
    print("fp8: " + ("pass" if ok else "FAIL: the FP8 run's loss is more than 5% above bf16's"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
