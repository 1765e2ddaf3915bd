"""The sequence-parallel unit (``mpu``) of the Hugging Face path: the groups a job's sequence axis splits
over, made before the engine exists.

DeepSpeed's ALST registers its attention with transformers and builds its data-loader adapter before
``deepspeed.initialize()``, so the groups must exist first: ``register_with_transformers`` returns a
unit that answers DeepSpeed's ``parallel_state_sp`` accessors, and ``initialize(mpu=unit)`` takes the
sequence degree from it.  The groups are laid out by the job's axes (``ParallelDims``: blocks of
consecutive ranks, see [Note: the order of the axes] in distributed/parallel_dims.py), the layout the
engine's own sequence groups have, so the unit's group and the engine's hold the same ranks.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch.distributed as dist

from ..distributed.parallel_dims import ParallelDims, SequenceParallelSizeError
from ..distributed.world import DEFAULT_TIMEOUT_S, release_at_exit

__all__ = ["SequenceParallelUnit", "sequence_parallel_unit", "latest_sequence_unit", "is_sequence_unit"]


class SequenceParallelUnit:
    """The sequence-parallel groups of a world of ``dp x sp`` ranks, under DeepSpeed's mpu names
    (``get_sequence_parallel_group``, ``..._world_size``, ``..._rank``, their ``sequence_data`` forms,
    and the ``get_model_parallel_*`` aliases DeepSpeed's unit has).  Every rank must build it at the same
    point (it creates process groups)."""

    def __init__(self, sequence_parallel_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not dist.is_initialized():
            raise SequenceParallelSizeError("a sequence-parallel unit needs the process group: call "
                                            "deepspeed.init_distributed() (or torch's) first")
        world = dist.get_world_size()
        if sequence_parallel_size < 2:
            raise SequenceParallelSizeError(f"sequence_parallel_size must be at least 2 here, got "
                                            f"{sequence_parallel_size}")
        self.dims = ParallelDims.for_job(world, sp=sequence_parallel_size)
        self.size = sequence_parallel_size
        me, self._group = dist.get_rank(), None
        for ranks in self.dims.groups("sequence"):
            group = dist.new_group(ranks=list(ranks), timeout=datetime.timedelta(seconds=timeout_s))
            if me in ranks:
                self._group = group
        release_at_exit(self._release)

    def _release(self) -> None:
        """At exit, let go of the group before the process groups are destroyed (see [Note: a clean exit]
        in distributed/world.py)."""
        self._group = None
        _units.pop(self.size, None)

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        """DeepSpeed's marker of a sequence-parallel unit (its ``groups`` module tests for this method);
        the groups exist already: a different size is refused."""
        if sequence_parallel_size != self.size:
            raise SequenceParallelSizeError(f"this unit splits sequences over {self.size} ranks, not "
                                            f"{sequence_parallel_size}")

    def get_sequence_parallel_group(self) -> Any:
        return self._group

    def get_sequence_parallel_world_size(self) -> int:
        return self.size

    def get_sequence_parallel_rank(self) -> int:
        return dist.get_rank(self._group)

    def get_sequence_data_parallel_group(self) -> Any:
        """Data x sequence: the whole world (ZeRO shards over it)."""
        return dist.group.WORLD

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank()

    def get_data_parallel_world_size(self) -> int:
        return self.dims.dp

    def get_data_parallel_rank(self) -> int:
        return self.dims.coords(dist.get_rank()).data

    # DeepSpeed's unit names its only axis beside data "model parallel" too
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank

    def ranks(self) -> list[int]:
        """The global ranks of this rank's sequence group, in order."""
        return list(dist.get_process_group_ranks(self._group))


_units: dict[int, SequenceParallelUnit] = {}


def sequence_parallel_unit(sequence_parallel_size: int) -> SequenceParallelUnit:
    """The process's unit of ``sequence_parallel_size``, built on first use (by every rank alike) and
    kept while the default process group lives."""
    unit = _units.pop(sequence_parallel_size, None)
    if unit is None or not _alive(unit):
        unit = SequenceParallelUnit(sequence_parallel_size)
    _units[sequence_parallel_size] = unit  # the newest last
    return unit


def latest_sequence_unit() -> Optional[SequenceParallelUnit]:
    """The unit built or asked for last; None before any."""
    return next(reversed(_units.values()), None)


def _alive(unit: SequenceParallelUnit) -> bool:
    group = unit.get_sequence_parallel_group()
    try:
        return group is not None and dist.get_rank(group) >= 0
    except (RuntimeError, ValueError):  # its groups went with a destroyed process group
        return False


def is_sequence_unit(mpu: Optional[Any]) -> bool:
    """Whether ``initialize(mpu=...)`` got a sequence-parallel unit (DeepSpeed's test: the unit has
    ``initialize_sequence_parallel``) rather than a tensor-parallel one."""
    return mpu is not None and callable(getattr(mpu, "initialize_sequence_parallel", None)) \
        and callable(getattr(mpu, "get_sequence_parallel_world_size", None))
