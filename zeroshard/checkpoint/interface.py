"""What a checkpoint reads from and writes into: the training state's parts, as a declared protocol.

``checkpoint/`` never imports the engine: it works on anything that has these parts (the engine
does), so the dependency goes one way, engine -> checkpoint, and the format code can be read and
tested on its own.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn
from torch.optim import Optimizer

from ..distributed.collectives import Collectives
from ..distributed.world import World
from ..optim.updater import ShardUpdater
from ..precision import LossScaler
from ..sharding.storage import ParameterStorage
from ..sharding.strategy import ShardingStrategy


class TrainingState(Protocol):
    """The parts of a training run a checkpoint saves and restores."""

    module: nn.Module
    world: World
    comm: Collectives
    flat: ParameterStorage  # the parameter storage (flat at stages 0-2, sharded at stage 3)
    strategy: ShardingStrategy
    updater: ShardUpdater  # the optimizer's pieces and where they live
    optimizer: Optimizer
    lr_scheduler: Any
    loss_scaler: LossScaler
    data_loader: Any
    param_names: list[str]
    global_steps: int
    micro_steps: int
    global_samples: int
    skipped_steps: int

    @property
    def stage(self) -> int: ...

