"""The training engine and what it owns: forward/backward/step (engine.py), the parts chosen from the
job's axes (parts.py), the optimizer step (optimizer_step.py), its checkpoint methods (checkpoints.py),
the step counters, the per-step metrics and the data loader that knows its position."""

from .engine import Engine, ModelChangedError

__all__ = ["Engine", "ModelChangedError"]
