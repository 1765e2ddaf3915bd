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

[Note: phases on a device]
A CPU timer does not see a GPU's work: a kernel is queued in microseconds and runs later, so without
more a device's time lands in whichever phase happens to wait for it (a host read, the next
collective).  In the profiled steps only, the clock synchronises the device at every phase boundary
(``torch.cuda.synchronize``: every stream, NCCL's included) before it reads the wall clock, so that a
phase's wall time is the time until the device has done what the phase queued.  CUDA events would
keep the step's overlap of host and device, but they time one stream's timeline, not the work on
NCCL's and the copies' own streams, and they cannot tell what the host waited for; a breakdown whose
phases add up to the step needs the device idle at each boundary.  What that costs in honesty:

- the step is serialised (no host work runs ahead of the device), so its phases add up to more than
  an unprofiled step, which is why the timed steps run without the clock (they synchronise only before
  and after each step);
- an NCCL collective's transfer is counted to the phase that launched it (``collective launch``), and
  its ``wait`` shows only what was left, nothing;
- ``host reads`` are the step's own synchronisations (reads of a device tensor's value, and
  ``torch.cuda.synchronize``); its calls are the syncs per step and its wall the reads alone, as the
  device had caught up at the boundary before each;
- the CPU the training threads spin away inside the boundary syncs is left out of every phase and
  shown as a row of its own, so that the phases still add up to the threads' CPU.

On CUDA, backward runs on autograd's thread for the device, not on the thread that called
``backward()``, and the gradient hooks with it: the clock counts that thread's CPU with the training
thread's (the caller waits while it runs) and times phases on either thread.
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
#: on a device only: the step's own synchronisations (counted as host reads: see [Note: phases on a device])
DEVICE_SYNCS: list[tuple[str, Optional[str], str, Optional[str]]] = [
    ("torch.cuda", None, "synchronize", "host reads"),
    ("torch.cuda", "Event", "synchronize", "host reads"),
    ("torch.cuda", "Stream", "synchronize", "host reads"),
]
#: on a device only: the training threads' CPU inside the clock's own boundary syncs
BOUNDARY_SYNCS = "device syncs at phase boundaries (profiling only)"


def autograd_thread(device: torch.device) -> int:
    """The thread that runs backward for ``device`` (autograd keeps one per device, for the process's life)."""
    seen: list[int] = []
    leaf = torch.zeros(1, device=device, requires_grad=True)
    leaf.register_hook(lambda grad: seen.append(threading.get_ident()))
    (leaf * 2).sum().backward()
    return seen[0]


class PhaseClock:
    """Exclusive CPU (thread) and wall seconds per phase, on the thread that created it; on a CUDA
    ``device`` also on autograd's thread for it, the device synchronised at every boundary (see
    [Note: phases on a device])."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.thread = threading.get_ident()
        self.threads = {self.thread}  # the threads whose phases are timed
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[Any]] = []  # [phase, cpu0, wall0, cpu of children, wall of children]
        self.on_device = device is not None and device.type == "cuda"
        self._synchronize: Optional[Callable[[], None]] = None
        self._sync_cpu, self._syncs = 0.0, 0
        if device is not None and self.on_device:
            # the function itself, taken before Installed wraps it (its calls from the step are host reads)
            self._synchronize = functools.partial(torch.cuda.synchronize, device)
            self.threads.add(autograd_thread(device))
            self._clocks = [time.pthread_getcpuclockid(t) for t in sorted(self.threads)]

    def threads_cpu(self) -> float:
        """CPU seconds of the timed threads so far (the training thread's alone off a device)."""
        if not self.on_device:
            return time.thread_time()
        return sum(time.clock_gettime(c) for c in self._clocks)

    def _now(self) -> tuple[float, float]:
        """(CPU of the timed threads less the boundary syncs', wall), the device idle on a device."""
        if self._synchronize is None:
            return time.thread_time(), time.perf_counter()
        before = self.threads_cpu()
        self._synchronize()
        after = self.threads_cpu()
        self._sync_cpu += after - before
        self._syncs += 1
        return after - self._sync_cpu, time.perf_counter()

    def push(self, phase: str) -> None:
        self._stack.append([phase, *self._now(), 0.0, 0.0])

    def pop(self) -> None:
        cpu_now, wall_now = self._now()
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
        if self.on_device:
            out[BOUNDARY_SYNCS] = {"cpu_s": self._sync_cpu, "wall_s": 0.0, "calls": self._syncs}
        self.cpu, self.wall, self.calls = defaultdict(float), defaultdict(float), defaultdict(int)
        self._sync_cpu, self._syncs = 0.0, 0
        return out


def _wrap(clock: PhaseClock, fn: Callable[..., Any], phase: Optional[str],
          device_tensors_only: bool = False) -> Callable[..., Any]:
    """``fn`` timed as ``phase`` when called on a timed thread inside a step; ``device_tensors_only``:
    only when its first argument is a device tensor (a read of a CPU tensor syncs nothing)."""
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() not in clock.threads or not clock._stack \
                or (device_tensors_only and args[0].device.type == "cpu"):
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
        for module_path, cls_name, attr, phase in TARGETS + (DEVICE_SYNCS if clock.on_device else []):
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
            setattr(torch.Tensor, attr, _wrap(clock, original, "host reads", device_tensors_only=clock.on_device))

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
