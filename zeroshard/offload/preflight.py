"""Checks made before training with NVMe offload, so that a bad path or a small disk fails at once.

Every rank checks its own needs; the verdicts are combined with one all-reduce, so that every rank
raises (a rank that failed alone would leave the others waiting in their next collective).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

from ..distributed.collectives import Collectives
from ..host.process_memory import proc_bytes


class OffloadPreflightError(RuntimeError):
    """NVMe offload cannot start: the path, the disk or the host memory does not fit."""


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    available = proc_bytes("/proc/meminfo", "MemAvailable")
    return available if available is not None else 1 << 62  # unknown: do not refuse


def _check(path: str, key: str, disk_bytes: int, host_bytes: int, ranks_sharing: int) -> Optional[str]:
    if not os.path.exists(path):
        return f"{key} {path!r} does not exist: create it, or point {key} at a directory on a fast local disk"
    if not os.path.isdir(path):
        return f"{key} {path!r} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".zeroshard_probe_"):
            pass
    except OSError as err:
        return f"{key} {path!r} is not writable ({err.strerror})"
    free = shutil.disk_usage(path).free
    need = disk_bytes * ranks_sharing
    if free < need:
        return (f"{key} {path!r} has {free / 2**30:.2f} GiB free but the swap files of {ranks_sharing} rank(s) "
                f"need {need / 2**30:.2f} GiB ({disk_bytes:,} bytes each)")
    available = available_host_bytes()
    if host_bytes * ranks_sharing > available:
        return (f"the offload buffers need {host_bytes * ranks_sharing / 2**30:.2f} GiB of host memory "
                f"({host_bytes:,} bytes per rank x {ranks_sharing}) but only {available / 2**30:.2f} GiB is "
                f"available: lower buffer_count or sub_group_size / buffer_size")
    return None


def preflight_nvme(comm: Collectives, path: str, key: str, disk_bytes: int, host_bytes: int) -> None:
    """Raise :class:`OffloadPreflightError` on every rank if the check fails on any."""
    ranks_sharing = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world.world_size))
    problem = _check(path, key, disk_bytes, host_bytes, ranks_sharing)
    failed = comm.all_reduce_scalar(1.0 if problem else 0.0, "offload_preflight") if comm.world.is_distributed \
        else float(bool(problem))
    if problem:
        raise OffloadPreflightError(problem)
    if failed:
        raise OffloadPreflightError(f"NVMe offload pre-flight check failed on {int(failed)} other rank(s) "
                                    f"(their log says why)")
