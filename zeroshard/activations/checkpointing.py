"""Activation checkpointing: keep a region's inputs, recompute its activations during backward.

Built on ``torch.utils.checkpoint`` (both modes: ``use_reentrant=False``, PyTorch's recommendation and
our default, and ``use_reentrant=True``, DeepSpeed's historical behaviour).  What zeroshard adds is
the ``activation_checkpointing`` config block, and making it work with ZeRO:

- Stage 3 gathers a unit's parameters when backward reaches it (a hook on the unit's outputs), which
  is before the recomputation of a checkpointed unit runs, so recomputation finds them gathered; a
  forward hook firing *during backward* is a recomputation and never releases the unit (see
  :meth:`GatherScheduler.in_backward`).  This also holds for ``torch.utils.checkpoint`` called
  directly, e.g. by a Hugging Face model's ``gradient_checkpointing_enable()``.
- Gradients reach zeroshard's buckets through post-accumulate-grad hooks, which fire once per
  parameter per backward in both modes, also for a weight used twice inside one checkpointed region.
  One pattern is refused with an error: with ``use_reentrant=True``, a parameter used both inside and
  outside a checkpointed region gets two separate gradient accumulations (one in the nested backward),
  and its bucket may already be reduced when the second arrives.  DeepSpeed refuses it too; use the
  default ``use_reentrant=False``.

[Note: whose settings a region uses]
``checkpoint(function, *args)`` is a free function, as in DeepSpeed and torch, called from deep inside
model code that has no handle on the engine.  Each engine keeps its own settings (its config's
``activation_checkpointing`` block) and its own profile, and makes them the current ones for the
duration of its forward (:func:`using`, a context variable); a region reads the current settings
when it runs.  Outside any engine's forward, and inside one whose config has no such block, the
process-wide settings apply: those of DeepSpeed's ``deepspeed.checkpointing.configure(...)``
(``zeroshard.deepspeed.checkpointing``), set through :func:`use_settings`.  Two engines in one process thus
never see each other's settings.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ..config.schema import ActivationCheckpointingConfig
from ..device.policy import device_policy


@dataclass
class CheckpointProfile:
    """Totals since the last :func:`take_profile` (``profile: true``)."""

    regions: int = 0  # checkpointed forwards run
    forward_s: float = 0.0
    recomputations: int = 0
    recompute_s: float = 0.0


@dataclass
class CheckpointingContext:
    """Settings and profile totals of one owner: an engine, or the process (DeepSpeed's ``configure``)."""

    settings: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    profile: CheckpointProfile = field(default_factory=CheckpointProfile)

    def take_profile(self) -> CheckpointProfile:
        """The totals since the previous call (then reset)."""
        taken, self.profile = self.profile, CheckpointProfile()
        return taken


_PROCESS = CheckpointingContext()
_CURRENT: ContextVar[Optional[CheckpointingContext]] = ContextVar("zeroshard_checkpointing", default=None)
#: modules whose forward ``checkpoint_modules`` wrapped -> their own forward
_WRAPPED: "weakref.WeakKeyDictionary[nn.Module, Callable[..., Any]]" = weakref.WeakKeyDictionary()


def current() -> CheckpointingContext:
    """The settings a region run now uses (see [Note: whose settings a region uses])."""
    return _CURRENT.get() or _PROCESS


@contextlib.contextmanager
def using(context: CheckpointingContext) -> Iterator[None]:
    """Make ``context`` the current one inside the block (an engine's forward)."""
    token = _CURRENT.set(context)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def use_settings(settings: Optional[ActivationCheckpointingConfig]) -> None:
    """Set the process-wide settings (DeepSpeed's ``configure``); engines with their own block keep theirs."""
    _PROCESS.settings = settings or ActivationCheckpointingConfig()


def current_process_settings() -> ActivationCheckpointingConfig:
    """The process-wide settings (those :func:`use_settings` set last)."""
    return _PROCESS.settings


def take_profile() -> CheckpointProfile:
    """The process-wide timing totals gathered with ``profile: true`` since the previous call (then reset)."""
    return _PROCESS.take_profile()


def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool = False, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    Gradients equal those of running ``function`` directly.  With ``cpu_checkpointing`` the positional
    tensor arguments (what a checkpoint keeps) are held in host memory until recomputation (nothing
    to move on a CPU device; keyword tensors stay where they are); ``synchronize_checkpoint_boundary`` waits for the device at both ends of the
    region; ``profile`` times the forward and the recomputation.
    """
    context = current()
    settings, profile = context.settings, context.profile
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    # the region runs where its inputs are: their device's policy, not the engine's (a region may run
    # outside any engine)
    policy = device_policy(device) if device is not None else None
    calls = [0]
    # cpu_checkpointing hands torch's checkpoint host tensors only, so it would preserve the CPU's
    # random state alone: the device's (dropout on a GPU) is saved and restored here.
    device_rng: dict[str, torch.Tensor] = {}
    own_device_rng = settings.cpu_checkpointing and policy is not None and policy.is_accelerator

    def run(inner: tuple[Any, ...]) -> Any:
        if settings.cpu_checkpointing and device is not None:
            inner = tuple(_to_device(a, device) if isinstance(a, torch.Tensor) else a for a in inner)
        return function(*inner, **({} if use_reentrant else kwargs))

    def region(*inner: Any) -> Any:
        recomputing = calls[0] > 0
        calls[0] += 1
        if settings.synchronize_checkpoint_boundary and policy is not None:
            policy.synchronize()
        started = time.perf_counter()
        try:
            if not own_device_rng:
                return run(inner)
            assert device is not None and policy is not None
            if not recomputing:
                device_rng["state"] = policy.rng_state()
                return run(inner)
            with torch.random.fork_rng(devices=[device]):
                policy.set_rng_state(device_rng["state"])
                return run(inner)
        finally:
            if settings.synchronize_checkpoint_boundary and policy is not None:
                policy.synchronize()
            if settings.profile:
                elapsed = time.perf_counter() - started
                if recomputing:
                    profile.recomputations += 1
                    profile.recompute_s += elapsed
                else:
                    profile.regions += 1
                    profile.forward_s += elapsed

    if use_reentrant and kwargs:
        function = functools.partial(function, **kwargs)  # the reentrant mode takes positional tensors only
    if settings.cpu_checkpointing:
        args = tuple(_to_host(a) if isinstance(a, torch.Tensor) else a for a in args)
    return torch_checkpoint(region, *args, use_reentrant=use_reentrant, preserve_rng_state=True)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """[Note: a checkpointed input's trip to the host]
    With ``cpu_checkpointing`` a region's inputs are kept in host memory.  From a GPU they are copied
    without waiting (``non_blocking``: torch puts the copy in page-locked memory), and back with the
    same, so neither trip stops the host: the copy back is queued on the stream after the copy out,
    nothing reads the host copy on the host, and torch keeps a page-locked block from reuse until the
    copies that read it have run.  A pageable copy would wait for the GPU twice per region, in the
    forward and again in the recomputation."""
    return tensor.to("cpu", non_blocking=tensor.is_cuda)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A checkpointed input back on ``device`` (see [Note: a checkpointed input's trip to the host])."""
    return tensor.to(device, non_blocking=tensor.is_pinned())


def checkpoint_modules(model: nn.Module, *classes: type, use_reentrant: bool = False) -> int:
    """Checkpoint every submodule of ``model`` that is an instance of one of ``classes``.

    One line to checkpoint each transformer block: ``checkpoint_modules(model, Block)``.  The module's
    own ``forward`` is wrapped, so its hooks (stage 3's gathers) and its state-dict names are unchanged.
    Returns how many modules were wrapped.
    """
    if not classes:
        raise ValueError("checkpoint_modules needs at least one module class, e.g. checkpoint_modules(model, Block)")
    wrapped = 0
    for module in model.modules():
        if isinstance(module, classes) and module not in _WRAPPED:
            original = module.forward
            _WRAPPED[module] = original

            def forward(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                return checkpoint(_original, *args, use_reentrant=use_reentrant, **kwargs)

            # an instance attribute shadows the class's forward (setattr: mypy forbids assigning a method)
            setattr(module, "forward", forward)
            wrapped += 1
    if not wrapped:
        raise ValueError(f"checkpoint_modules found no submodule of type "
                         f"{', '.join(c.__name__ for c in classes)} in {type(model).__name__}")
    return wrapped
