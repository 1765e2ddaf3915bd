"""``deepspeed.runtime.activation_checkpointing.offload_activations``: checkpointed layers' inputs moved
to the host between forward and backward (:mod:`zeroshard.activations.hidden_states_offload`, over
:mod:`zeroshard.activations.offload`), under DeepSpeed's names."""

from __future__ import annotations

from ....activations.hidden_states_offload import (CheckpointHiddenStatesOffload,
                                                   get_checkpoint_hidden_states_offloading_ctx_manager)
from ....activations.offload import ActivationOffloader as _ActivationOffloadEngine
from ....activations.offload import OffloadStats as CheckpointActivationOffloadStats

__all__ = ["CheckpointHiddenStatesOffload", "CheckpointActivationOffloadStats",
           "get_checkpoint_hidden_states_offloading_ctx_manager"]
