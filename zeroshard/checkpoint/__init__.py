"""Sharded checkpoints: versioned manifest + safetensors shards; resharding load; offline tools."""

from .consolidate import consolidate, describe
from .format import FORMAT_VERSION, CheckpointError
from .load import load_checkpoint
from .reader import CheckpointReader
from .save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate", "describe", "CheckpointReader",
           "CheckpointError", "FORMAT_VERSION"]
