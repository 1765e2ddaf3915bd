"""``deepspeed.runtime.activation_checkpointing``: where DeepSpeed keeps activation checkpointing.

Its ``checkpointing`` is ``deepspeed.checkpointing`` itself (:mod:`zeroshard.deepspeed.checkpointing`,
one module object under both names, as in DeepSpeed, so a setting assigned under one name is seen
under the other); ``offload_activations`` offloads checkpointed layers' inputs to the host.
"""

from __future__ import annotations

import sys

from ... import checkpointing
from . import offload_activations

sys.modules[f"{__name__}.checkpointing"] = checkpointing

__all__ = ["checkpointing", "offload_activations"]
