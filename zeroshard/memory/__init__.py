"""Memory accounting: the ZeRO formulas and the engine's measured breakdown."""

from .accounting import StageMemory, model_state_bytes
from .estimator import EstimateRequest, ModelShape, StageEstimate, estimate_all, format_table, recommend

__all__ = ["StageMemory", "model_state_bytes", "EstimateRequest", "ModelShape", "StageEstimate", "estimate_all",
           "format_table", "recommend"]
