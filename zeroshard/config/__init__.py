"""Typed, strict, DeepSpeed-compatible configuration."""

from .loader import ConfigError, describe_keys, load_config, resolve_batch_sizes
from .schema import OptimizerConfig, SchedulerConfig, ZeroConfig, ZeroshardConfig

__all__ = ["ConfigError", "load_config", "resolve_batch_sizes", "describe_keys", "ZeroshardConfig",
           "ZeroConfig", "OptimizerConfig", "SchedulerConfig"]
