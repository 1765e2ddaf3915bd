"""Plots (matplotlib is an optional extra: ``pip install zeroshard[plot]``).

- :func:`plot_metrics`: loss, throughput and memory over steps, from a metrics JSONL file.
- :func:`plot_estimate`: stacked bars of parameters, gradients, optimizer state, activations and buffers
  per ZeRO stage, from ``zeroshard estimate``.
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
