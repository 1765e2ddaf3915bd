"""Per-phase CPU and wall time of a training step, for bench_step_ratio.py's ``--profile``.

Phases are attributed exclusively: while a phase runs, time spent in a phase nested inside it (a
collective's wait inside a gradient hook, a consistency check inside a launch) is counted to the inner
one only, so the phases of a step add up to the step.  The outer phases are the step's own marks
(``forward``, ``backward``, ``step``): what is left in them is the model's compute (autograd, the
optimizer kernel's callers, DDP's and FSDP2's C++ and Python that is not wrapped here).

Each phase records ``time.thread_time()`` (the CPU time of the training thread: what zeroshard's Python
and the kernels it calls cost, nearly independent of what else runs on the machine) and
``time.perf_counter()`` (wall: what the step waited for, on a loaded machine mostly the load).  Only
the training thread is timed: the threads that carry gloo's rings forward (zeroshard's
distributed/ring_progress.py) or gloo's own show up in the step's process CPU time, which
bench_step_ratio.py records for every step.

The wrappers are installed on classes (every engine in the process is timed) only for the profiled
steps and removed after: the timed steps run unwrapped.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Optional

import torch

#: (module path, class name or None for a module function, attribute, phase); a phase of None names
#: itself from the call (a collective's wait: by its label, digits dropped)
TARGETS: list[tuple[str, Optional[str], str, Optional[str]]] = [
    ("zeroshard.engine.engine", None, "check_unchanged", "parameter identity check"),
    ("zeroshard.distributed.consistency", "ConsistencyCheck", "agree", "consistency check"),
    ("zeroshard.distributed.consistency", "ConsistencyCheck", "verify", "consistency check"),
    ("zeroshard.distributed.collectives", "Collectives", "_run", "collective launch"),
    ("zeroshard.distributed.collectives", "PendingCollective", "wait", None),
    ("zeroshard.sharding.strategy", "ShardingStrategy", "_on_grad_ready", "grad hooks (Python)"),
    ("zeroshard.sharding.strategy", "ShardingStrategy", "_retire", "bucket retire (Python)"),
    ("zeroshard.sharding.strategy", "ShardingStrategy", "finish_backward", "end of backward (Python)"),
    ("zeroshard.sharding.full_grads", "FullGradientStrategy", "store_grad", "copy into buckets"),
    ("zeroshard.sharding.sharded_grads", "ShardedGradientStrategy", "store_grad", "copy into buckets"),
    ("zeroshard.sharding.full_grads", "FullGradientStrategy", "ready_to_reduce", "bucket prepare"),
    ("zeroshard.sharding.sharded_grads", "ShardedGradientStrategy", "launch", "bucket prepare"),
    ("zeroshard.sharding.stage0", "Stage0", "complete", "copy out of buckets"),
    ("zeroshard.sharding.stage1", "Stage1", "complete", "copy out of buckets"),
    ("zeroshard.sharding.sharded_grads", "ShardedGradientStrategy", "complete", "copy out of buckets"),
    ("zeroshard.sharding.stage3.strategy", "Stage3", "expect_gradients", "stage 3 graph walk"),
    ("zeroshard.sharding.stage3.gather_agreement", "GatherAgreement", "_round", "stage 3 gather rounds"),
    ("zeroshard.sharding.stage3.gather_scheduler", "GatherScheduler", "use", "stage 3 scheduler (Python)"),
    ("zeroshard.sharding.stage3.gather_scheduler", "GatherScheduler", "done_with", "stage 3 scheduler (Python)"),
    ("zeroshard.sharding.stage3.gather_scheduler", "GatherScheduler", "release_all", "stage 3 scheduler (Python)"),
    ("zeroshard.sharding.stage3.sharded_params", "ShardedParameters", "gather", "stage 3 gather (launch, copy)"),
    ("zeroshard.sharding.stage3.sharded_params", "ShardedParameters", "release", "stage 3 release"),
    ("zeroshard.sharding.stage3.sharded_params", "ShardedParameters", "take_back_chunks", "stage 3 release"),
    ("zeroshard.engine.optimizer_step", "OptimizerStep", "run", "optimizer step (zeroshard Python)"),
    ("zeroshard.engine.parts", "ShardNorm", "__call__", "grad norm"),
    ("zeroshard.optim.updater", "ShardUpdater", "step_bucket", "optimizer step (zeroshard Python)"),
    ("zeroshard.sharding.strategy", "ShardingStrategy", "refresh_bucket", "param gather launch"),
    ("torch.optim.adam", "Adam", "step", "AdamW"),
    ("torch.optim.adamw", "AdamW", "step", "AdamW"),  # torch patches a profiling hook into the class
    ("torch.optim.optimizer", "Optimizer", "zero_grad", "zero_grad"),
]
#: reads of a tensor's value on the host (each one waits for a device; here each costs a call)
HOST_READS = ("item", "tolist", "__float__", "__bool__", "__int__")


class PhaseClock:
    """Exclusive CPU (thread) and wall seconds per phase, on the thread that created it."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[Any]] = []  # [phase, cpu0, wall0, cpu of children, wall of children]

    def push(self, phase: str) -> None:
        self._stack.append([phase, time.thread_time(), time.perf_counter(), 0.0, 0.0])

    def pop(self) -> None:
        cpu_now, wall_now = time.thread_time(), time.perf_counter()
        phase, cpu0, wall0, child_cpu, child_wall = self._stack.pop()
        cpu, wall = cpu_now - cpu0, wall_now - wall0
        self.cpu[phase] += cpu - child_cpu
        self.wall[phase] += wall - child_wall
        self.calls[phase] += 1
        if self._stack:
            self._stack[-1][3] += cpu
            self._stack[-1][4] += wall

    def mark(self, phase: str) -> None:
        """Close the current outer phase (if any) and open ``phase`` (the step's own marks)."""
        while self._stack:
            self.pop()
        if phase:
            self.push(phase)

    def take(self) -> dict[str, dict[str, float]]:
        self.mark("")
        out = {p: {"cpu_s": self.cpu[p], "wall_s": self.wall[p], "calls": self.calls[p]} for p in self.cpu}
        self.cpu, self.wall, self.calls = defaultdict(float), defaultdict(float), defaultdict(int)
        return out


def _wrap(clock: PhaseClock, fn: Callable[..., Any], phase: Optional[str]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != clock.thread or not clock._stack:
            return fn(*args, **kwargs)
        name = phase or "wait " + re.sub(r"\d+", "", getattr(args[0], "label", "collective"))
        clock.push(name)
        try:
            return fn(*args, **kwargs)
        finally:
            clock.pop()
    return timed


class Installed:
    """The wrappers of :data:`TARGETS` and the host reads, installed until :meth:`remove`."""

    def __init__(self, clock: PhaseClock) -> None:
        import importlib

        self._undo: list[tuple[Any, str, Any]] = []
        for module_path, cls_name, attr, phase in TARGETS:
            try:
                module = importlib.import_module(module_path)
            except ImportError:
                continue
            owner = module if cls_name is None else getattr(module, cls_name, None)
            if owner is None or attr not in vars(owner):
                continue
            original = vars(owner)[attr]
            self._undo.append((owner, attr, original))
            setattr(owner, attr, _wrap(clock, original, phase))
            if cls_name is None:  # a function imported by name elsewhere: patch where it is called
                self._patch_importers(module_path, attr, original, clock, phase)
        for attr in HOST_READS:
            original: Callable[..., Any] = getattr(torch.Tensor, attr)
            self._undo.append((torch.Tensor, attr, original))
            setattr(torch.Tensor, attr, _wrap(clock, original, "host reads"))

    def _patch_importers(self, module_path: str, attr: str, original: Any, clock: PhaseClock,
                         phase: Optional[str]) -> None:
        import sys

        for name, module in list(sys.modules.items()):
            if name.startswith("zeroshard") and name != module_path and getattr(module, attr, None) is original:
                self._undo.append((module, attr, original))
                setattr(module, attr, _wrap(clock, original, phase))

    def remove(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo = []
