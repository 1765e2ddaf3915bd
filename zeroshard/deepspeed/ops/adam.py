"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam``, torch's fused Adam/AdamW under
DeepSpeed's names (zeroshard/optim/fused_adam.py).  They are torch optimizers, so ``initialize()``
rebuilds them over the shards like any other; the config's ``Adam``/``AdamW`` builds them too.
"""

from __future__ import annotations

from ...optim.fused_adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]
