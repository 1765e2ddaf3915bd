"""What a checkpoint reads from and writes into: the training state's parts, as declared protocols.

``checkpoint/`` never imports the engine: the engine composes its stateful parts into
:class:`CheckpointParts` and hands them over, so the dependency goes one way, engine -> checkpoint.
Each part has a ``state_dict()`` / ``load_state_dict()`` (the sharded part reads and writes bucket by
bucket, in its declared chunk layout).  A load validates the whole checkpoint, on every rank, before
any part's ``load_state_dict`` runs (see [Note: a load is all or nothing] in checkpoint/load.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
from torch import nn

from ..distributed.collectives import Collectives
from ..distributed.world import World
from ..sharding.layout import BucketLayout, FlatLayout
from ..sharding.storage import ParameterStorage


class Stateful(Protocol):
    """A part whose state is a JSON-able value (counters, loss scale, LR schedule, loader position)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class TensorStateful(Protocol):
    """A part whose state is a few named tensors of this rank (the RNG streams)."""

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


class ShardedStateful(Protocol):
    """This rank's chunks of every bucket and their optimizer state, in a declared layout."""

    @property
    def layout(self) -> FlatLayout: ...

    @property
    def rank(self) -> int:
        """This rank's position in the group the chunks are sharded over."""

    def rank_of(self, bucket: BucketLayout) -> int:
        """This rank's chunk of ``bucket`` (its position in the group that bucket is sharded over)."""

    def chunk_ranks(self, bucket: BucketLayout) -> tuple[int, int]:
        """``(rank_base, rank_stride)``: chunk ``c`` of ``bucket`` is saved by rank ``rank_base + c *
        rank_stride`` of the group the checkpoint is written by."""

    @property
    def writes_chunks(self) -> bool:
        """Whether this rank's file holds its chunks (MiCS: only the first shard group's ranks)."""

    @property
    def saved_dtype(self) -> torch.dtype: ...

    @property
    def compute_dtype(self) -> torch.dtype: ...

    def chunk_layout(self) -> list[tuple[int, int]]:
        """Per bucket: (chunk size, number of chunks)."""

    def read_bucket(self, bucket: BucketLayout, copy: bool = True) -> tuple[
            torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]: ...

    def write_bucket(self, bucket: BucketLayout, values: torch.Tensor, state: Optional[dict[str, torch.Tensor]],
                     scalars: dict[str, torch.Tensor]) -> None: ...

    def publish(self) -> None: ...

    def spread_state(self) -> None:
        """Before a save, on every rank: state kept whole on one rank put into chunks (see [Note:
        whole-matrix state in a checkpoint] in optim/whole_matrices.py)."""


class ModuleStateful(Protocol):
    """The model's keys and its non-trainable tensors."""

    def describe(self) -> dict[str, Any]: ...

    def extra_tensors(self, trainable_keys: set[str], keep: bool = True,
                      exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
        """Every rank calls it (it may gather); ranks that do not ``keep`` get nothing."""

    def load_extra(self, values: dict[str, torch.Tensor]) -> None: ...


class OptimizerGroups(Stateful, Protocol):
    @property
    def class_name(self) -> str: ...


@dataclass(frozen=True)
class PartOfJob:
    """Where one part's state goes in a checkpoint of a job that trains its model in parts, each part
    over a group of ranks of its own (the stages of a pipeline): see [Note: a checkpoint of a job in
    parts] in checkpoint/job.py.  The parts' shards and module then carry the job's names."""

    #: which part this rank trains, of how many
    part: int
    parts: int
    #: the job rank of the part's first rank: the part's chunk ``c`` is saved in ``rank_file(rank_base + c)``
    rank_base: int
    #: this rank writes its part's frozen parameters and buffers
    leader: bool
    #: every trainable parameter name of the job (what a strict load may find beyond this part's)
    job_param_names: frozenset[str]


@dataclass(frozen=True)
class SpreadExperts:
    """Expert parallelism: each expert-parallel rank's experts are saved under their global names, in
    buckets of their own (see [Note: experts in a checkpoint] in experts/checkpoint.py)."""

    #: this rank holds the first chunk of its experts' buckets: its manifest entries join rank 0's
    leads: bool
    #: every parameter name of the job's experts (what a strict load may find beyond this rank's)
    names: frozenset[str]


@dataclass
class CheckpointParts:
    """Everything a checkpoint saves and restores, part by part."""

    world: World
    comm: Collectives
    stage: int
    shards: ShardedStateful
    module: ModuleStateful
    optimizer: OptimizerGroups
    counters: Stateful
    loss_scaler: Stateful
    rng: TensorStateful
    #: every rank is loading the same checkpoint (its manifest's digest), or every rank raises
    agree_on: Callable[[str], None]
    lr_scheduler: Optional[Stateful] = None
    loader: Optional[Stateful] = None
    #: set when ``world`` and ``comm`` are the whole job's and these parts hold one part of its model
    job: Optional[PartOfJob] = None
    #: set when the model's experts are spread over the ranks (expert parallelism)
    experts: Optional[SpreadExperts] = None
    #: where zeroshard split the model's layers over a tensor-parallel group: this rank's share, of how
    #: many, and the dimension each split parameter is split along (a tensor-parallel job's checkpoint is
    #: read at this size: [Note: a tensor-parallel checkpoint read at another size] in
    #: checkpoint/tensor_parts.py)
    tensor_slice: Optional[tuple[int, int, dict[str, int]]] = None


class LiveEngine(Protocol):
    """What ``load_pretrained`` fills in a live engine (checkpoint/pretrained.py): the wrapped model, the
    storage its trained parameters live in, the frozen parameters it keeps whole, and its checkpoint
    parts (whose shards take the owned chunks and publish them)."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def storage(self) -> ParameterStorage: ...

    @property
    def frozen_params(self) -> Sequence[torch.Tensor]: ...

    def checkpoint_parts(self) -> CheckpointParts: ...
