"""What DeepSpeed's ZeRO-3 parameter attributes (``ds_id``, ``ds_status``, ``ds_numel``, ``ds_shape``,
``ds_tensor``) answer here, and the status enum they use.

[Note: DeepSpeed's parameter attributes on zeroshard's own types]
Libraries written for DeepSpeed (Hugging Face, PEFT, Accelerate, TRL) recognise a ZeRO-3 parameter by
``hasattr(p, "ds_id")`` and read its full size from ``p.ds_numel`` because DeepSpeed empties ``p``
itself.  zeroshard does not set attributes on a user's tensors ([Note: the parameter registry] in
sharding/storage.py), so the attributes are properties of zeroshard's own parameter types, answered
from the storage when read: the placeholder a module shows while a parameter is released
(sharding/stage3/placeholder.py) and the parameter ``zeroshard.Init`` builds (sharding/stage3/init_param.py).
While a parameter is gathered (in forward, backward, ``GatheredParameters``) its module shows the real
parameter with its full values, and that plain tensor has no ``ds_*`` attribute: code that checks
``hasattr(p, "ds_id")`` treats it as the ordinary full tensor it then is.  A placeholder read during a
gather (a reference kept from before) reports ``INFLIGHT`` or ``AVAILABLE`` from the storage.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol

import torch


class ZeroParamStatus(Enum):
    """Whether a stage-3 parameter's full values are present (DeepSpeed's names)."""

    AVAILABLE = 1  # gathered
    NOT_AVAILABLE = 2  # only this rank's shard exists
    INFLIGHT = 3  # all-gather in flight


class PartitionedStorage(Protocol):
    """What the ``ds_*`` properties ask the stage-3 storage that holds a parameter."""

    def partition_status(self, bucket: int) -> ZeroParamStatus:
        """Whether bucket ``bucket`` is gathered, being gathered, or only sharded."""

    def own_part(self, bucket: int, index: int) -> torch.Tensor:
        """This rank's elements of parameter ``index`` (1D, possibly empty: a parameter may lie wholly
        in other ranks' chunks of its bucket)."""
