"""Per-step training metrics: what rank 0 logs every ``steps_per_print`` steps, and the JSONL file.

Each record holds the step, loss, learning rate, gradient norm before clipping, samples/s, tokens/s,
an estimated TFLOP/s (6 x parameters x tokens per second: forward plus backward of a dense model),
peak device and host memory, and the bytes and seconds spent in collectives since the last record.
With ``wall_clock_breakdown`` it adds the seconds spent in forward, backward and step.
:class:`EngineMetrics` is the engine's part that keeps the window and writes the records; the engine
hands it what it read at the step (:class:`StepReadings`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..activations import checkpointing as activation_checkpointing
from ..host.process_memory import host_peak_bytes
from ..logging import log_rank

if TYPE_CHECKING:
    from ..config import ZeroshardConfig
    from ..distributed.collectives import Collectives
    from ..distributed.world import World

__all__ = ["EngineMetrics", "MetricsWriter", "PhaseTimers", "StepReadings", "host_peak_bytes"]


@dataclass
class PhaseTimers:
    """Seconds spent in each phase since the last record (``wall_clock_breakdown``)."""

    seconds: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0, "step": 0.0})

    def add(self, phase: str, started: float) -> None:
        self.seconds[phase] += time.perf_counter() - started

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {k: 0.0 for k in self.seconds}
        return out


class MetricsWriter:
    """Appends one JSON object per record to ``path`` (rank 0 only), and to TensorBoard if asked."""

    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str] = None,
                 csv_dir: Optional[str] = None) -> None:
        """``csv_dir``: also append each numeric metric to ``csv_dir/<metric>.csv`` (``step,<metric>``
        rows under a header line), one file per metric as DeepSpeed's csv_monitor lays them out."""
        self.path = Path(path) if path else None
        self.csv_dir = Path(csv_dir) if csv_dir else None
        if self.csv_dir is not None:
            self.csv_dir.mkdir(parents=True, exist_ok=True)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb: Any = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError("config key 'tensorboard.enabled' is true but the tensorboard package is not "
                                  "installed: pip install tensorboard, or set it to false") from None
            self._tb = SummaryWriter(tensorboard_dir)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, record["step"])
            self._tb.flush()
        if self.csv_dir is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    file = self.csv_dir / f"{key}.csv"
                    new = not file.exists()
                    with open(file, "a") as f:
                        f.write((f"step,{key}\n" if new else "") + f"{record['step']},{value}\n")


@dataclass(frozen=True)
class StepReadings:
    """What the engine knows at a record: its counters, the last loss and norm, the settings of the step."""

    step: int
    #: the last micro step's loss, on the device until the record reads it (see [Note: one host read
    #: per optimizer step] in engine/optimizer_step.py)
    loss: Optional[torch.Tensor]
    lr: float
    grad_norm: Optional[float]
    train_batch_size: int
    #: trainable parameters (for the TFLOP/s estimate)
    numel: int
    loss_scale: float
    skipped_steps: int


class EngineMetrics:
    """The engine's metrics: the window since the last record, the phase timers, the JSONL /
    TensorBoard / CSV writer (rank 0), and the progress line every ``steps_per_print`` steps."""

    def __init__(self, config: "ZeroshardConfig", world: "World", comm: "Collectives",
                 checkpointing: Optional[activation_checkpointing.CheckpointingContext]) -> None:
        self.config, self.world, self.comm, self.checkpointing = config, world, comm, checkpointing
        self._window_start = time.perf_counter()
        self._window_steps = 0
        self._window_comm = (0, 0.0)
        #: token ids seen by forward passes with gradients since the last record
        self.tokens = 0
        self.timers = PhaseTimers()
        #: the last record (``engine.last_metrics``)
        self.last: Optional[dict[str, Any]] = None
        tb, csv, main = config.tensorboard, config.csv_monitor, world.is_main
        self._writer = MetricsWriter(
            config.metrics_path if main else None,
            str(Path(tb.output_path or ".") / tb.job_name) if tb.enabled and main else None,
            str(Path(csv.output_path or ".") / csv.job_name) if csv.enabled and main else None)

    def log_progress(self, readings: StepReadings) -> None:
        """A log line on rank 0, and the JSONL / TensorBoard record."""
        record = self.record(readings)
        self.last = record
        if self.world.is_main:
            self._writer.write(record)
        line = (f"step {record['step']}: loss {record['loss']:.4f} lr {record['lr']:.3e} "
                f"grad_norm {record['grad_norm']:.4f} samples/s {record['samples_per_s']:.1f} "
                f"tokens/s {record['tokens_per_s']:.0f} TFLOP/s {record['tflops']:.3f} "
                f"comm {record['comm_mib']:.1f} MiB/{record['comm_s']:.2f}s "
                f"host peak {record['host_peak_mib']:.0f} MiB")
        if self.config.wall_clock_breakdown:
            line += " | " + " ".join(f"{k} {record[k + '_s']:.3f}s" for k in ("forward", "backward", "step"))
        log_rank(line)

    def record(self, readings: StepReadings) -> dict[str, Any]:
        """The metrics since the previous record (resets the window)."""
        now = time.perf_counter()
        elapsed = max(now - self._window_start, 1e-9)
        steps = readings.step - self._window_steps
        tokens_per_s = self.tokens * self.world.world_size / elapsed
        comm_bytes = self.comm.total_bytes_sent()
        comm_seconds = sum(c.seconds for c in self.comm.counters.values())
        record: dict[str, Any] = {
            "step": readings.step, "loss": None if readings.loss is None else float(readings.loss),
            "lr": readings.lr,
            "grad_norm": readings.grad_norm, "samples_per_s": steps * readings.train_batch_size / elapsed,
            "tokens_per_s": tokens_per_s, "tflops": 6 * readings.numel * tokens_per_s / 1e12,
            "comm_mib": (comm_bytes - self._window_comm[0]) / 2**20, "comm_s": comm_seconds - self._window_comm[1],
            "host_peak_mib": host_peak_bytes() / 2**20, "device_peak_mib": self.world.device_policy.peak_bytes() / 2**20,
            "loss_scale": readings.loss_scale, "skipped_steps": readings.skipped_steps,
        }
        if self.config.wall_clock_breakdown:
            record.update({f"{k}_s": v for k, v in self.timers.take().items()})
        if self.config.activation_checkpointing.profile:
            profile = (self.checkpointing or activation_checkpointing.current()).take_profile()
            record.update({"checkpoint_regions": profile.regions, "checkpoint_forward_s": profile.forward_s,
                           "checkpoint_recomputations": profile.recomputations,
                           "checkpoint_recompute_s": profile.recompute_s})
        self._window_start, self._window_steps, self.tokens = now, readings.step, 0
        self._window_comm = (comm_bytes, comm_seconds)
        return record
