"""How often a training step makes the host wait for a tensor's value.

[Note: what counts as a host sync]
On a GPU, every read of a device tensor's value on the host (``.item()``, ``float(t)``, ``if t:``,
``.tolist()``) and every ``torch.cuda.synchronize()`` stalls the CPU until the GPU has caught up, and
the CPU can no longer queue work ahead: the step's kernels run with gaps between them.  Two counts:

- ``reads``: calls to those Python methods on tensors (patched on ``torch.Tensor`` while counting), and
  to ``torch.cuda.synchronize``.  On a CPU run every read is counted (CPU tensors cost nothing to read,
  but the same line reads a device tensor on a GPU); on a CUDA run only reads of device tensors.
  Reads inside torch's C++ code are not seen.
- ``device_syncs`` (CUDA only): the warnings of ``torch.cuda.set_sync_debug_mode("warn")``, which CUDA
  itself raises for every synchronizing call, C++ ones included (copies to the host, ``nonzero``, ...).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Optional

import torch

#: the ``torch.Tensor`` methods that hand a value to the host
READS = ("item", "__float__", "__int__", "__bool__", "tolist")
#: the directory that holds the ``zeroshard`` package (a checkout's root, or site-packages), whatever
#: its own name: sites are named relative to it (this file is zeroshard/tools/selftest/syncs.py)
SOURCE_ROOT = Path(__file__).resolve().parents[3]


@functools.lru_cache(maxsize=None)
def site_path(filename: str) -> str:
    """``filename`` (a code object's) relative to ``SOURCE_ROOT`` with ``/`` separators, such as
    ``zeroshard/engine/engine.py``; a file outside that directory keeps its path as given."""
    try:
        return Path(os.path.realpath(filename)).relative_to(SOURCE_ROOT).as_posix()
    except ValueError:
        return filename


class SyncCounter:
    """``with SyncCounter(device) as counter: ...``; then ``counter.reads``, ``counter.sites`` (the
    reads by the ``file:line`` that made them) and ``counter.device_syncs`` (None off CUDA).  Not
    reentrant; counts calls from every thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reads = 0
        self.sites: Counter[str] = Counter()
        self.device_syncs: Optional[int] = 0 if device.type == "cuda" else None
        self._saved: dict[str, Any] = {}
        self._caught: Optional[list[warnings.WarningMessage]] = None
        self._warnings: Optional[warnings.catch_warnings] = None
        self._debug_mode = 0

    def _counting(self, original: Callable[..., Any]) -> Callable[..., Any]:
        on_cpu = self.device.type == "cpu"

        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if on_cpu or tensor.device.type != "cpu":
                self._count(sys._getframe(1))
            return original(tensor, *args, **kwargs)
        return read

    def _count_synchronize(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def synchronize(*args: Any, **kwargs: Any) -> Any:
            self._count(sys._getframe(1))
            return original(*args, **kwargs)
        return synchronize

    def _count(self, caller: FrameType) -> None:
        self.reads += 1
        self.sites[f"{site_path(caller.f_code.co_filename)}:{caller.f_lineno}"] += 1

    def __enter__(self) -> "SyncCounter":
        for name in READS:
            self._saved[name] = torch.Tensor.__dict__.get(name)  # None: inherited from the C base
            setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name)))
        self._saved["synchronize"] = torch.cuda.synchronize
        torch.cuda.synchronize = self._count_synchronize(torch.cuda.synchronize)  # type: ignore[assignment]
        if self.device.type == "cuda":
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            self._debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(self._debug_mode)
            assert self._warnings is not None and self._caught is not None
            self._warnings.__exit__(*exc)
            self.device_syncs = sum("synchroniz" in str(w.message) for w in self._caught)
        torch.cuda.synchronize = self._saved.pop("synchronize")
        for name, original in self._saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        self._saved.clear()
