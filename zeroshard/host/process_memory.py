"""This process's host memory as the kernel counts it (``/proc``): the figures the metrics log, the
CPU accelerator reports and the NVMe preflight checks against."""

from __future__ import annotations

from typing import Optional

__all__ = ["proc_bytes", "host_peak_bytes"]


def proc_bytes(path: str, field: str) -> Optional[int]:
    """A ``field: N kB`` line of a /proc file, in bytes (None where /proc or the field is missing)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_peak_bytes() -> int:
    """This process's RSS high-water mark (VmHWM; 0 where /proc is not available)."""
    return proc_bytes("/proc/self/status", "VmHWM") or 0
