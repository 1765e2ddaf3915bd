"""Per-step training metrics: what rank 0 logs every ``steps_per_print`` steps, and the JSONL file.

Each record holds the step, loss, learning rate, gradient norm before clipping, samples/s, tokens/s,
an estimated TFLOP/s (6 x parameters x tokens per second: forward plus backward of a dense model),
peak device and host memory, and the bytes and seconds spent in collectives since the last record.
With ``wall_clock_breakdown`` it adds the seconds spent in forward, backward and step.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..host.process_memory import host_peak_bytes

__all__ = ["MetricsWriter", "PhaseTimers", "host_peak_bytes"]


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
