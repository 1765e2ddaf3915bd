"""Memory accounting: the ZeRO formulas and the engine's measured breakdown."""

from .accounting import StageMemory, model_state_bytes

__all__ = ["StageMemory", "model_state_bytes"]
