"""The sharded training state a checkpoint saves per rank: owned parameter chunks and their optimizer state.

The part composes the updater (where the optimizer's values and state live: device, host, NVMe) and
the strategy (which publishes updated chunks into the full parameters), behind the few methods a
checkpoint needs.  Its layout (per bucket: chunk size and count) is what lets a checkpoint be read
back at any world size and stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.optim import Optimizer

from ..sharding.layout import BucketLayout, FlatLayout
from .updater import BucketState, ShardUpdater

if TYPE_CHECKING:
    from ..sharding.strategy import ShardingStrategy


class ShardedState:
    """This rank's chunks of every bucket (fp32 masters when there are any) and their optimizer state."""

    def __init__(self, updater: ShardUpdater, strategy: "ShardingStrategy") -> None:
        self.updater = updater
        self.strategy = strategy

    @property
    def layout(self) -> FlatLayout:
        return self.strategy.layout

    @property
    def rank(self) -> int:
        return self.strategy.world.rank

    def rank_of(self, bucket: BucketLayout) -> int:
        return self.strategy.ranks.of(bucket)

    def chunk_ranks(self, bucket: BucketLayout) -> tuple[int, int]:
        """Chunk ``c`` is this engine's rank ``c``: the experts' buckets' are renamed before a save (see
        [Note: experts in a checkpoint] in experts/checkpoint.py)."""
        return 0, 1

    @property
    def writes_chunks(self) -> bool:
        """Whether this rank's file holds its chunks: under MiCS only the first shard group's ranks
        (ranks 0..S-1, whose files are then those of a world of S) write them; the others hold copies."""
        replicas = self.strategy.replicas
        return replicas is None or replicas.world.rank == 0

    @property
    def saved_dtype(self) -> torch.dtype:
        """The dtype the chunks are saved in: fp32 masters if any, else the parameters' dtype."""
        return torch.float32 if self.strategy.masters is not None else self.strategy.storage.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.strategy.storage.dtype

    def chunk_layout(self) -> list[tuple[int, int]]:
        """Per bucket: (chunk size, number of chunks) as this engine owns them (stage 0: one whole chunk)."""
        return [(self.updater.owned_numel(b), b.padded_numel // self.updater.owned_numel(b))
                for b in self.layout.buckets]

    def read_bucket(self, bucket: BucketLayout, copy: bool = True) -> BucketState:
        return self.updater.read_bucket(bucket, copy)

    def write_bucket(self, bucket: BucketLayout, values: torch.Tensor, state: Optional[dict[str, torch.Tensor]],
                     scalars: dict[str, torch.Tensor]) -> None:
        self.updater.write_bucket(bucket, values, state, scalars)

    def spread_state(self) -> None:
        """Before a save, on every rank: the whole-matrix state into chunks (see [Note: whole-matrix state
        in a checkpoint] in optim/whole_matrices.py)."""
        self.updater.spread_state()

    def publish(self) -> None:
        """After writing every bucket: make the full parameters current wherever they are kept whole."""
        for bucket in self.layout.buckets:
            self.strategy.refresh_bucket(bucket)
        self.strategy.finish_refresh()


class OptimizerHyperparameters:
    """The optimizer's per-group hyperparameters (lr, betas, weight decay, ...), without its tensors."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def class_name(self) -> str:
        return type(self.optimizer).__name__

    def state_dict(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.state_dict()["param_groups"]]

    def load_state_dict(self, groups: list[dict[str, Any]]) -> None:
        if len(groups) != len(self.optimizer.param_groups):
            return  # a different grouping: keep this run's hyperparameters
        for group, values in zip(self.optimizer.param_groups, groups):
            group.update({k: tuple(v) if k == "betas" else v for k, v in values.items()})
