"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: DeepSpeed's sequence-parallel unit as module
functions, over the process's unit (zeroshard/sequence/unit.py: the one ``initialize_sequence_parallel``
or ``UlyssesSPAttentionHF.register_with_transformers`` built last)."""

from __future__ import annotations

from typing import Any

from ....sequence.groups import SequenceParallelError
from ....sequence.unit import SequenceParallelUnit, latest_sequence_unit, sequence_parallel_unit

__all__ = ["initialize_sequence_parallel", "get_sequence_parallel_group", "get_sequence_parallel_world_size",
           "get_sequence_parallel_rank", "get_sequence_data_parallel_group",
           "get_sequence_data_parallel_world_size", "get_sequence_data_parallel_rank", "get_model_parallel_group",
           "get_model_parallel_world_size", "get_model_parallel_rank"]


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the groups of ``sequence_parallel_size`` consecutive ranks (every rank calls it)."""
    sequence_parallel_unit(sequence_parallel_size)


def _unit() -> SequenceParallelUnit:
    unit = latest_sequence_unit()
    if unit is None:
        raise SequenceParallelError("the sequence parallel group is not initialized: call "
                                    "initialize_sequence_parallel() (or register_with_transformers()) first")
    return unit


def get_sequence_parallel_group() -> Any:
    return _unit().get_sequence_parallel_group()


def get_sequence_parallel_world_size() -> int:
    return _unit().get_sequence_parallel_world_size()


def get_sequence_parallel_rank() -> int:
    return _unit().get_sequence_parallel_rank()


def get_sequence_data_parallel_group() -> Any:
    return _unit().get_sequence_data_parallel_group()


def get_sequence_data_parallel_world_size() -> int:
    return _unit().get_sequence_data_parallel_world_size()


def get_sequence_data_parallel_rank() -> int:
    return _unit().get_sequence_data_parallel_rank()


get_model_parallel_group = get_sequence_parallel_group
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_rank = get_sequence_parallel_rank
