"""Peak RSS, like for like: DDP, FSDP2, zeroshard stages 0-3 (and DeepSpeed if importable), with an RSS timeline.

    .venv/bin/python benchmarks/bench_memory.py --size 91m [--dtype fp32|bf16] [--allocator default|fixed]
        [--steps 10] [--warmup 3] [--only ddp zeroshard_3] [--plot benchmarks/out/memory_91m.png]
    .venv/bin/python benchmarks/bench_memory.py --size tiny --steps 1 --warmup 2   # a smoke test (< 1 min)

Every implementation runs in a fresh world of 2 spawned processes (gloo, OMP_NUM_THREADS=1) and trains
zeroshard.tools.demo.model.GPT (tied embedding, vocabulary 8192, seq_len 128, micro batch 4) on the same
batches with ``torch.optim.AdamW(fused=True)``, lr 1e-4, weight decay 0.01 (zeroshard's builder adds
``fused=True`` to AdamW, zeroshard/optim/builder.py; asserted).  Sizes: ``tiny`` d_model 128 x 4 layers
(1.86M params), ``23m`` 384 x 11 (22.7M), ``91m`` 768 x 12 (91.4M; 16 bytes/param = 1395 MiB).
zeroshard runs DeepSpeed's default ``zero_optimization`` values (DEEPSPEED_DEFAULTS; overlap_comm left
at its default).  DDP: torch's defaults (25 MB buckets), gradients kept between steps as in
bench_stages.py; FSDP2: ``fully_shard`` per block, then the root (``reshard_after_forward=True``).

``--dtype bf16``: zeroshard ``"bf16": {"enabled": true}`` (bf16 parameters, fp32 masters, bf16
communication); FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` (fp32 sharded
parameters act as masters: the same split); DDP ``torch.autocast("cpu", bfloat16)`` around forward
(DDP has no bf16-parameter mode: fp32 parameters, per-op casts, fp32 gradients).
``--allocator fixed`` pins glibc's mmap and trim thresholds at 128 KiB for every implementation;
``default`` leaves glibc alone (no MALLOC_* variables).

Per rank: median step time of the measured steps, peak RSS (VmHWM), model-state bytes (zeroshard:
``memory_breakdown()``; the others computed as bench_stages.py does), and an RSS timeline: a thread
reads /proc/self/statm every ~5 ms while the main thread marks phase boundaries (init, then forward /
backward / step of each step) together with VmHWM at each mark, so the phase in which the high-water
mark last rose is exact even when the sampler misses a short spike.  Prints a markdown table, writes
benchmarks/out/memory_<size>_<dtype>.json, and with ``--plot`` a PNG of RSS against time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zeroshard  # noqa: E402
from zeroshard.tools.demo.model import GPT, GPTConfig  # noqa: E402
from zeroshard.tools.testing import run_world  # noqa: E402

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=8192, seq_len=128, d_model=128, n_layer=4, n_head=2),
    "23m": dict(vocab_size=8192, seq_len=128, d_model=384, n_layer=11, n_head=6),
    "91m": dict(vocab_size=8192, seq_len=128, d_model=768, n_layer=12, n_head=12),
}
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
#: ``zeroshard_<s>_release``: with zeroshard's explicit ``host_memory_release`` setting (glibc's thresholds
#: fixed at 1 MiB from initialize() on; see zeroshard/host/host_allocator.py); ``zeroshard_<s>_trim``: with
#: ``host_memory_trim`` (malloc_trim(0) after every step, glibc's settings untouched); ``zeroshard_<s>_overlap``
#: (stages 1-2, by --only): ``overlap_param_gather`` on; ``zeroshard_<s>_allreduce`` (stages 1-3, by --only):
#: ``reduce_scatter: false`` (each bucket all-reduced in place, as DDP does; see bench_collectives.py)
IMPLEMENTATIONS = ["ddp", "fsdp2", *(f"zeroshard_{s}" for s in range(4)), *(f"zeroshard_{s}_release" for s in range(1, 4)),
                   *(f"zeroshard_{s}_trim" for s in range(1, 4)),
                   *((f"deepspeed_{s}" for s in range(1, 4)) if HAVE_DEEPSPEED else ())]
#: DeepSpeed's documented zero_optimization defaults (https://www.deepspeed.ai/docs/config-json/)
DEEPSPEED_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
}
ADAMW: dict[str, Any] = {"lr": 1e-4, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
FIXED_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
MIB = 2**20


def batches(cfg: GPTConfig, rank: int, micro: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    data = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


class RSSTimeline(threading.Thread):
    """Samples RSS (/proc/self/statm) every ``interval`` s; ``mark`` records a phase boundary and VmHWM."""

    def __init__(self, interval: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.interval, self.t0, self.page = interval, time.perf_counter(), os.sysconf("SC_PAGE_SIZE")
        self.samples: list[tuple[float, float]] = []  # (s, RSS MiB)
        self.marks: list[tuple[float, str, float]] = []  # (s, phase starting, VmHWM MiB so far)
        self._done = threading.Event()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def run(self) -> None:
        while not self._done.is_set():
            self.samples.append((round(time.perf_counter() - self.t0, 4), round(self.rss() / MIB, 1)))
            self._done.wait(self.interval)

    def mark(self, phase: str) -> None:
        self.marks.append((round(time.perf_counter() - self.t0, 4), phase, round(vm_hwm() / MIB, 1)))

    def finish(self) -> None:
        self.mark("end")
        self._done.set()
        self.join()

    def peak_phase(self) -> str:
        """The phase during which VmHWM last rose (marks carry VmHWM at each phase's start)."""
        phase = "before start"
        for (_, name, hwm), (_, _, next_hwm) in zip(self.marks, self.marks[1:]):
            if next_hwm > hwm:
                phase = name
        return phase


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensors


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(local(v) for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
               for s in opt.state.values())


Step = Callable[[torch.Tensor, torch.Tensor, Callable[[str], None]], None]


def build(impl: str, model: GPT, micro: int, dtype: str,
          extra_config: Optional[dict[str, Any]] = None) -> tuple[Step, Callable[[], dict[str, float]]]:
    """The step function (marking forward/backward/step) and a function giving the model-state bytes.
    The torch implementations train where ``model`` is; ``extra_config``: top-level keys for the engines."""
    if impl.startswith(("zeroshard", "deepspeed")):
        return build_engine(impl, model, micro, dtype == "bf16", extra_config)
    return build_torch(impl, model, dtype == "bf16")


def build_engine(impl: str, model: GPT, micro: int, bf16: bool,
                 extra_config: Optional[dict[str, Any]] = None) -> tuple[Step, Callable[[], dict[str, float]]]:
    """zeroshard (or DeepSpeed) with DeepSpeed's default zero_optimization values."""
    stage = int(impl.split("_")[1])
    config: dict[str, Any] = {**(extra_config or {}),
                              "train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9,
                              "zero_optimization": {"stage": stage, **DEEPSPEED_DEFAULTS},
                              **({"bf16": {"enabled": True}} if bf16 else {}),
                              **({"host_memory_release": True} if impl.endswith("_release") else {}),
                              **({"host_memory_trim": True} if impl.endswith("_trim") else {})}
    if impl.endswith("_overlap"):  # stages 1-2: the post-step gather runs into the next forward
        config["zero_optimization"]["overlap_param_gather"] = True
    if impl.endswith("_allreduce"):
        config["zero_optimization"]["reduce_scatter"] = False
    if impl.startswith("zeroshard"):
        config["optimizer"] = {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}}
        engine, _, _, _ = zeroshard.initialize(model=model, config=config)
        assert all(g.get("fused") for g in engine.optimizer.param_groups), "not torch's fused AdamW"
    else:  # DeepSpeed, given torch's fused AdamW object (its own CPU Adam would be another kernel)
        import deepspeed  # type: ignore[import-not-found]

        engine, _, _, _ = deepspeed.initialize(model=model, config=config, dist_init_required=False,
                                               optimizer=torch.optim.AdamW(model.parameters(), fused=True, **ADAMW))

    def step(x: torch.Tensor, y: torch.Tensor, mark: Callable[[str], None]) -> None:
        mark("forward")
        loss = engine(x, y)
        mark("backward")
        engine.backward(loss)
        mark("step")
        engine.step()

    step.engine = engine  # type: ignore[attr-defined]  # for benchmarks that act on it (bench_compile.py)

    def states() -> dict[str, float]:
        if impl.startswith("deepspeed"):
            return {"model_states": float("nan")}  # DeepSpeed has no breakdown: not reported
        return dict(engine.memory_breakdown())
    return step, states


def build_torch(impl: str, model: GPT, bf16: bool) -> tuple[Step, Callable[[], dict[str, float]]]:
    """DDP or FSDP2 with torch's fused AdamW, on the model's device."""
    device = next(model.parameters()).device
    if impl == "fsdp2":
        from zeroshard.tools.selftest.throughput import fsdp2_per_block

        wrapped: torch.nn.Module = fsdp2_per_block(model, bf16)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, bucket_cap_mb=25, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)

    def step(x: torch.Tensor, y: torch.Tensor, mark: Callable[[str], None]) -> None:
        mark("forward")
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and impl == "ddp"):
            loss = wrapped(x, y)
        mark("backward")
        loss.backward()
        mark("step")
        opt.step()
        opt.zero_grad(set_to_none=impl == "fsdp2")  # DDP keeps its gradients, as bench_stages.py

    def states() -> dict[str, float]:
        params = tensor_bytes(local(p) for p in model.parameters())
        grads = params if impl == "fsdp2" else tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
        opt_bytes = optimizer_state_bytes(opt)  # FSDP2: grads freed by zero_grad(), counted as params
        return {"params": params, "grads": grads, "optimizer": opt_bytes, "model_states": params + grads + opt_bytes}
    return step, states


def worker(rank: int, world: int, impl: str, cfg_dict: dict, micro: int, steps: int, warmup: int,
           dtype: str) -> dict:
    timeline = RSSTimeline()
    timeline.start()
    timeline.mark("init")
    cfg = GPTConfig(**cfg_dict)
    torch.manual_seed(0)
    model = GPT(cfg)
    psi = sum(p.numel() for p in model.parameters())
    step, states = build(impl, model, micro, dtype)
    times = []
    for i in range(warmup + steps):
        x, y = batches(cfg, rank, micro, i)
        start = time.perf_counter()
        step(x, y, lambda phase: timeline.mark(f"{phase} {i}"))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    timeline.finish()
    return {"median_step_s": statistics.median(times), "peak_rss_bytes": vm_hwm(), "peak_phase": timeline.peak_phase(),
            "states": states(), "params": psi, "samples": timeline.samples, "marks": timeline.marks}


def plot(results: dict[str, dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 2.6 * len(results)), sharey=True, squeeze=False)
    for ax, (impl, r) in zip(axes[:, 0], results.items()):
        for rank, (samples, style) in enumerate(zip(r["samples_per_rank"], ("-", ":"))):
            ax.plot([s[0] for s in samples], [s[1] for s in samples], style, lw=0.8, label=f"rank {rank}")
        for t, phase, _ in r["marks_per_rank"][0]:
            if phase.startswith("forward"):
                ax.axvline(t, color="grey", lw=0.5)
        marks = r["marks_per_rank"][0]
        for (t, phase, _), (t_next, _, _) in zip(marks, marks[1:]):
            if phase.startswith("backward"):
                ax.axvspan(t, t_next, color="tab:orange", alpha=0.12)
        ax.axhline(max(r["peak_rss_mib_per_rank"]), color="red", ls="--", lw=0.6)
        ax.set(title=f"{impl}: peak {max(r['peak_rss_mib_per_rank']):.0f} MiB in {r['peak_phase_per_rank'][0]}",
               ylabel="RSS (MiB)")
        ax.legend(loc="lower right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since process start (grey: forward starts, orange: backward)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="91m")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--allocator", choices=["default", "fixed"], default="default")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="measured steps (default: steps 3-12)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=IMPLEMENTATIONS)
    parser.add_argument("--out", default=None, help="default benchmarks/out/memory_<size>_<dtype>.json")
    parser.add_argument("--plot", default=None, help="write a PNG of RSS vs time per implementation")
    args = parser.parse_args()
    if not HAVE_DEEPSPEED:
        print("deepspeed is not importable: its rows are skipped")
    cfg = SIZES[args.size]
    env = {"OMP_NUM_THREADS": "1", **(FIXED_ALLOCATOR if args.allocator == "fixed" else {})}
    for name in FIXED_ALLOCATOR:  # the default allocator means no MALLOC_* tuning from our environment
        if args.allocator == "default" and name in os.environ:
            raise SystemExit(f"--allocator default but {name} is set in the environment: unset it")
    results: dict[str, dict] = {}
    for impl in args.only:
        ranks = run_world(worker, 2, args=(impl, cfg, args.micro_batch, args.steps, args.warmup, args.dtype),
                          timeout=3600, env=env)
        results[impl] = {
            "median_step_s": max(r["median_step_s"] for r in ranks),
            "peak_rss_mib_per_rank": [r["peak_rss_bytes"] / MIB for r in ranks],
            "model_state_mib_per_rank": [r["states"]["model_states"] / MIB for r in ranks],
            "peak_phase_per_rank": [r["peak_phase"] for r in ranks],
            "states_per_rank": [r["states"] for r in ranks], "params": ranks[0]["params"],
            "samples_per_rank": [r["samples"] for r in ranks], "marks_per_rank": [r["marks"] for r in ranks],
        }
        print(f"finished {impl}: peak {results[impl]['peak_rss_mib_per_rank']} MiB", flush=True)
    base: Optional[float] = results.get("ddp", {}).get("median_step_s")
    print(f"\nGPT {cfg}, {next(iter(results.values()))['params']:,} parameters, world 2, {args.dtype}, micro batch "
          f"{args.micro_batch}, median of steps {args.warmup}-{args.warmup + args.steps - 1} (slowest rank), "
          f"allocator {args.allocator}\n")
    print("| impl | step (s) | vs DDP | peak RSS r0/r1 (MiB) | model state (MiB) | peak phase (r0/r1) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for impl, r in results.items():
        ratio = f"{r['median_step_s'] / base:.2f}" if base else "-"
        peak = "/".join(f"{m:.0f}" for m in r["peak_rss_mib_per_rank"])
        print(f"| {impl} | {r['median_step_s']:.2f} | {ratio} | {peak} | {max(r['model_state_mib_per_rank']):.0f} | "
              f"{' / '.join(r['peak_phase_per_rank'])} |")
    out = Path(args.out or f"benchmarks/out/memory_{args.size}_{args.dtype}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": cfg, "args": vars(args), "deepspeed_defaults": DEEPSPEED_DEFAULTS,
                               "results": results}))
    print(f"\nwrote {out}")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
