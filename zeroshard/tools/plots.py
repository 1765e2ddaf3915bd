"""Plots (matplotlib is an optional extra: ``pip install zeroshard[plot]``).

- :func:`plot_metrics`: loss, throughput and memory over steps, from a metrics JSONL file.
- :func:`plot_estimate`: stacked bars of parameters, gradients, optimizer state, activations and buffers
  per ZeRO stage, from ``zeroshard estimate``.
- :func:`plot_selftest`: ``zeroshard selftest``'s checks: each correctness case against its bound,
  tokens/s and host reads per step by implementation, and collective bandwidth by message size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'zeroshard[plot]' (or matplotlib)") from None
    return plt


def plot_metrics(metrics_path: str | Path, out: str | Path) -> Path:
    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{metrics_path}: no metrics records")
    plt = _pyplot()
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(steps, [r["loss"] for r in records], marker="o")
    axes[0].set(title="loss", xlabel="step")
    axes[1].plot(steps, [r["tokens_per_s"] for r in records], marker="o", color="tab:green")
    axes[1].set(title="throughput (tokens/s, all ranks)", xlabel="step")
    axes[2].plot(steps, [r["host_peak_mib"] for r in records], marker="o", label="host peak (rank 0)")
    if any(r.get("device_peak_mib") for r in records):
        axes[2].plot(steps, [r["device_peak_mib"] for r in records], marker="o", label="device peak (rank 0)")
    axes[2].set(title="memory (MiB)", xlabel="step")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)


def plot_estimate(estimates: Sequence[Any], out: str | Path, title: str = "") -> Path:
    plt = _pyplot()
    parts = ("params", "grads", "optimizer", "activations", "buffers")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bottom = [0.0] * len(estimates)
    labels = [f"stage {e.stage}" for e in estimates]
    for part in parts:
        values = [getattr(e, part) / 1e9 for e in estimates]
        ax.bar(labels, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.4g}", ha="center", va="bottom")
    ax.set(ylabel="GB per rank (decimal)", title=title or "per-rank memory by ZeRO stage")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)


def plot_selftest(results: dict[str, Any], out: str | Path) -> Path:
    """Four panels from ``zeroshard selftest --json``'s results (tools/selftest/verdict.py's ``judge``)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    cases = results.get("correctness") or []
    bounds = results.get("bounds", {})
    ratios, colors = [], []
    for c in cases:
        bound = bounds.get("fp32_rel" if c["precision"] == "fp32" else "bf16_deviation", 1.0)
        worst = max(v for v in (c.get("vs_one_process"), c.get("vs_ddp")) if v is not None)
        ratios.append(max(worst / bound, 1e-6))
        colors.append("tab:green" if c.get("passed") else "tab:red")
    labels = [f"{c['stage']}/{c['precision']}/{c['accumulation']}" for c in cases]
    axes[0, 0].bar(labels, ratios, color=colors)
    axes[0, 0].axhline(1.0, color="black", lw=0.8)
    axes[0, 0].set(title="correctness: difference / bound (stage/precision/accumulation)", yscale="log")
    axes[0, 0].tick_params(axis="x", rotation=60, labelsize=7)
    records = [r for r in results.get("throughput") or [] if "tokens_per_s" in r]
    names = [r["implementation"] for r in records]
    axes[0, 1].bar(names, [r["tokens_per_s"] for r in records], color="tab:green")
    axes[0, 1].set(title=f"throughput (tokens/s, all ranks; {results.get('size')}, {results.get('precision')})")
    axes[1, 0].bar(names, [r["host_reads_per_step"] for r in records], label="host reads")
    if any(r.get("device_syncs_per_step") is not None for r in records):
        axes[1, 0].plot(names, [r.get("device_syncs_per_step") or 0 for r in records], "o", color="tab:red",
                        label="device syncs (CUDA)")
    axes[1, 0].set(title="host syncs per steady-state step")
    axes[1, 0].legend()
    rows = results.get("bandwidth") or []
    for scope, op in sorted({(r["scope"], r["op"]) for r in rows}):
        mine = [r for r in rows if (r["scope"], r["op"]) == (scope, op)]
        axes[1, 1].plot([r["bytes"] / 2**20 for r in mine], [r["busbw_gb_s"] for r in mine], marker="o",
                        label=f"{op} ({scope}, {mine[0]['ranks']} ranks)")
    axes[1, 1].set(title="collective bus bandwidth (GB/s)", xlabel="MiB", xscale="log")
    if rows:
        sizes = sorted({r["bytes"] / 2**20 for r in rows})
        axes[1, 1].set_xticks(sizes, [f"{s:.3g}" for s in sizes])
        axes[1, 1].legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)
