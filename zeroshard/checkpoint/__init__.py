"""Sharded checkpoints: versioned manifest + safetensors shards; resharding load; offline tools.  Under
``install_as_deepspeed()`` this is also ``deepspeed.checkpoint``: DeepSpeed's ``DeepSpeedCheckpoint``, its
file-name helpers, the Megatron-style reshape maps (``model_3d_desc``, ``get_model_3d_descriptor``,
``ZeROCheckpoint``), ``constants`` and ``ds_to_universal`` (its format: deepspeed_format/)."""

from .consolidate import consolidate, describe
from .deepspeed_format.ds_checkpoint import DeepSpeedCheckpoint
from .deepspeed_format.layout_metadata import get_model_3d_descriptor
from .deepspeed_format.reshape_maps import model_3d_desc, reshape_meg_2d_parallel
from .deepspeed_format.zero_checkpoint import ZeROCheckpoint, merge_state
from .format import FORMAT_VERSION, CheckpointError
from .load import load_checkpoint
from .reader import CheckpointReader
from .save import save_checkpoint
from .utils import get_layer_ckpt_name_for_rank, get_model_ckpt_name_for_rank, get_zero_ckpt_name_for_rank

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate", "describe", "CheckpointReader",
           "CheckpointError", "FORMAT_VERSION", "DeepSpeedCheckpoint", "get_model_ckpt_name_for_rank",
           "get_zero_ckpt_name_for_rank", "get_layer_ckpt_name_for_rank", "ZeROCheckpoint", "model_3d_desc",
           "get_model_3d_descriptor", "reshape_meg_2d_parallel", "merge_state"]
