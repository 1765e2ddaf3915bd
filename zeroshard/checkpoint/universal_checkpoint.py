"""DeepSpeed's ``deepspeed.checkpoint.universal_checkpoint``: a universal checkpoint's parameters loaded
into one tensor-parallel rank, one parameter at a time (deepspeed_format/tp_restore.py), and the
description of fused sub-parameters (deepspeed_format/tp_layout.py), under DeepSpeed's names.

zeroshard's engine loads universal folders through its own loader (deepspeed_format/universal_read.py);
these are the per-parameter functions that DeepSpeed's optimizers attach to their parameters and that
tools written against DeepSpeed call.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .deepspeed_format.tp_layout import SubparamShape
from .deepspeed_format.tp_restore import (autotp_slice, enable_universal_checkpoint, load_hp_checkpoint_state,
                                          restore_meta)

__all__ = ["SubparamShape", "load_hp_checkpoint_state", "enable_universal_checkpoint"]


def _get_param_uc_restore_meta(param: Any) -> Optional[dict[str, Any]]:
    """DeepSpeed's name for :func:`restore_meta`."""
    return restore_meta(param)


def _resolve_autotp_partition(current_param: Any, ckpt_dict: dict[str, Any], full_hp_param: torch.Tensor,
                              tp_rank: int, tp_world_size: int, state_key: str = "fp32") -> Optional[torch.Tensor]:
    """DeepSpeed's name for :func:`autotp_slice` (``ckpt_dict`` and ``state_key`` matter only to affine
    maps, which zeroshard refuses)."""
    return autotp_slice(current_param, full_hp_param, tp_rank, tp_world_size)
