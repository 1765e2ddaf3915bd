"""The engine's step counters, as one part with a state dict (saved in every checkpoint's manifest)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional


@dataclass
class TrainingCounters:
    """Optimizer steps, micro steps, samples seen, and steps skipped for non-finite gradients."""

    global_steps: int = 0
    micro_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_steps = int(state["global_steps"])
        self.micro_steps = int(state["micro_steps"])
        self.global_samples = int(state["global_samples"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def resume_at_boundary(self, gradient_accumulation_steps: int) -> None:
        """Count the micro steps of the ``global_steps`` taken so far as ``gradient_accumulation_steps``
        each: a loaded run resumes at a step boundary.

        A checkpoint's ``micro_steps`` count micro steps of the accumulation it was saved with.  An
        engine that resumes with another (an elastic job keeps the global batch as its world changes)
        finds its boundaries from ``micro_steps``: the saved count would end its first step early and
        shift every later one.
        """
        self.micro_steps = self.global_steps * gradient_accumulation_steps


class Counter:
    """An engine attribute that is one of its :class:`TrainingCounters` (DeepSpeed's ``global_steps``, ...)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: Any, owner: Optional[type] = None) -> int:
        return int(getattr(engine.counters, self.name))

    def __set__(self, engine: Any, value: int) -> None:
        setattr(engine.counters, self.name, value)
