"""``deepspeed.zero``: ``Init``, ``GatheredParameters``, ``ZeroParamStatus``, external parameters.

The machinery is zeroshard's own (:mod:`zeroshard.init_context`, :mod:`zeroshard.gathered`,
:mod:`zeroshard.sharding.units`); this module only speaks DeepSpeed's signatures over it.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..gathered import GatheredParameters
from ..init_context import Init as _Init
from ..sharding.units import register_external_parameter, unregister_external_parameter

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]


class ZeroParamStatus(Enum):
    """Whether a stage-3 parameter's full values are present (DeepSpeed's names)."""

    AVAILABLE = 1  # gathered
    NOT_AVAILABLE = 2  # only this rank's shard exists
    INFLIGHT = 3  # all-gather in flight


class Init(_Init):
    """``deepspeed.zero.Init`` with DeepSpeed's keywords, over :class:`zeroshard.Init`.

    - ``config_dict_or_path`` / ``config``: the DeepSpeed config (its collective timeout is used;
      Hugging Face passes the training config, ``"auto"`` values included).
    - ``dtype``: the dtype floating-point parameters are built in (default: as the model makes them;
      zeroshard's masters start from those unrounded values).
    - ``remote_device`` ``"cpu"`` keeps the shards in host memory until ``initialize()``.
    - ``data_parallel_group`` must be the whole world and ``mpu`` None: zeroshard has no model
      parallelism; ``module=`` (partitioning an existing model) is refused: build the model inside the
      block, or pass it to ``initialize()`` at stage 3, which shards it there.
    """

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None,
                 pin_memory: bool = False, config_dict_or_path: Any = None, config: Any = None,
                 enabled: bool = True, dtype: Optional[torch.dtype] = None, mpu: Any = None,
                 **unsupported: Any) -> None:
        refused = {k: v for k, v in unsupported.items() if v not in (None, False)}
        if refused:
            raise ValueError(f"zeroshard.zero.Init does not support {sorted(refused)} (they need model, "
                             f"sequence or quantized parallelism, which zeroshard does not have)")
        if module is not None:
            raise ValueError("zeroshard.zero.Init(module=...) is not supported: build the model inside "
                             "`with zeroshard.zero.Init():`, or pass it to initialize() at stage 3, which "
                             "shards it there")
        if mpu is not None:
            raise ValueError("zeroshard.zero.Init(mpu=...): zeroshard has no model parallelism; pass mpu=None")
        if data_parallel_group not in (None, dist.group.WORLD):
            raise ValueError("zeroshard.zero.Init(data_parallel_group=...): zeroshard shards over the whole "
                             "world; pass None or torch.distributed.group.WORLD")
        if remote_device not in (None, "none", "cpu"):
            raise ValueError(f"zeroshard.zero.Init(remote_device={remote_device!r}): 'cpu' or None (NVMe "
                             f"parameter offload is configured with zero_optimization.offload_param)")
        super().__init__(config_dict_or_path if config_dict_or_path is not None else config, enabled=enabled,
                         dtype=dtype, shard_device=torch.device("cpu") if remote_device == "cpu" else None)
        # mem_efficient_linear and pin_memory: accepted, with no meaning here (zeroshard computes with
        # torch's own linear; host memory is pinned as offload_param.pin_memory says)
        del mem_efficient_linear, pin_memory
