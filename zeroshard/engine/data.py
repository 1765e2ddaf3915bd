"""The distributed data loader that ``initialize(training_data=...)`` returns: it knows its position.

Each rank sees a disjoint, shuffled 1/N of the data set, ``micro_batch_size`` samples at a time.  The
loader counts the batches it has handed out in the current epoch and moves to the next epoch (a new
shuffle) by itself when one ends, so a checkpoint can record exactly where training was and a resumed
run continues with the very next batch.

[Note: a loader that is a stream]
Iterating the loader again after a ``break`` continues the epoch with the next batch not yet handed
out (it does not restart the epoch): the recorded position is always the batches a script actually
received, and ``for batch in loader: ... break`` loops, resumed or not, see every batch once per epoch.
The loader never draws from torch's global generator (torch's DataLoader draws a seed from it each
time an iterator is made, unless it has a generator of its own, which it has here): a model that uses
the global generator (dropout) then draws the same numbers in a resumed run as in an uninterrupted one.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..distributed.world import World


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way through."""

    skip = 0  # indices of the next epoch's order to skip once

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())
        start, self.skip = self.skip, 0
        return iter(indices[start:])


class DistributedLoader:
    """A DataLoader over a :class:`ResumableSampler`, with ``state_dict()`` / ``load_state_dict()``."""

    def __init__(self, dataset: Dataset, micro_batch_size: int, world: World,
                 collate_fn: Optional[Callable[..., Any]] = None, seed: int = 0, drop_last: bool = False) -> None:
        self.micro_batch_size = micro_batch_size
        # ``drop_last`` (config ``dataloader_drop_last``): only full micro batches of distinct samples;
        # else every sample, each rank's share padded by repeats and its last micro batch possibly short
        self.sampler = ResumableSampler(dataset, num_replicas=world.world_size, rank=world.rank,
                                        shuffle=True, seed=seed, drop_last=drop_last)
        self.loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=self.sampler,
                                 collate_fn=collate_fn, drop_last=drop_last,
                                 generator=torch.Generator().manual_seed(seed))  # see the Note
        self.epoch = 0
        self.consumed = 0  # batches handed out in the current epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.skip = self.consumed * self.micro_batch_size  # continue the epoch (see the Note)
        for batch in self.loader:
            self.consumed += 1
            yield batch
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.consumed = 0
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.set_epoch(state["epoch"])
        # the position in samples, in this loader's micro batches (a resharded load may change their size)
        self.consumed = state["consumed"] * state["micro_batch_size"] // self.micro_batch_size


def build_loader(dataset: Dataset, micro_batch_size: int, world: World,
                 collate_fn: Optional[Callable[..., Any]] = None, seed: int = 0,
                 drop_last: bool = False) -> DistributedLoader:
    return DistributedLoader(dataset, micro_batch_size, world, collate_fn, seed, drop_last)
