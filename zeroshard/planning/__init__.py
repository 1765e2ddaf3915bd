"""Memory accounting: the ZeRO formulas and the engine's measured breakdown; the scale model, over data
parallelism and over tensor x data x pipeline layouts."""

from .accounting import StageMemory, hybrid_model_state_bytes, model_state_bytes, secondary_param_bytes
from .estimator import EstimateRequest, ModelShape, StageEstimate, estimate_all, estimate_hybrid, recommend
from .estimate_table import format_table
from .scale_model import (Cluster, CollectiveTraffic, Phase, ScaleEstimate, Sharding, StepTime, Traffic,
                          bubble_factor, default_shardings, format_scale_table, parse_bandwidth, recommend_scale,
                          scale_estimates, sharding_estimate, step_time, traffic_per_step)
from .parallel_search import format_layout_table, layout_estimates, search_layouts

__all__ = ["StageMemory", "model_state_bytes", "hybrid_model_state_bytes", "secondary_param_bytes",
           "EstimateRequest", "ModelShape", "StageEstimate", "estimate_all", "estimate_hybrid", "format_table",
           "recommend", "Cluster", "CollectiveTraffic", "Phase", "ScaleEstimate", "Sharding", "StepTime", "Traffic",
           "default_shardings", "format_scale_table", "parse_bandwidth", "recommend_scale", "scale_estimates",
           "step_time", "traffic_per_step", "bubble_factor", "sharding_estimate", "format_layout_table",
           "layout_estimates", "search_layouts"]
