"""The distributed data loader that ``initialize(training_data=...)`` returns."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .distributed.world import World


def build_loader(dataset: Dataset, micro_batch_size: int, world: World,
                 collate_fn: Optional[Callable[..., Any]] = None, seed: int = 0) -> DataLoader:
    """Each rank sees a disjoint, shuffled 1/N of the data set, ``micro_batch_size`` samples at a time.

    Call ``loader.sampler.set_epoch(epoch)`` each epoch for a new shuffle, as with any DistributedSampler.
    """
    sampler: DistributedSampler = DistributedSampler(dataset, num_replicas=world.world_size, rank=world.rank,
                                 shuffle=True, seed=seed, drop_last=True)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=True)
