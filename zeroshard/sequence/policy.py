"""How ``DistributedAttention`` computes attention over split sequences, chosen once from the config's
``sequence_parallel`` block when the engine is built: DeepSpeed-Ulysses' all-to-all around the model's
local attention, or the ring of sequence/ring.py."""

from __future__ import annotations

from dataclasses import dataclass

from ..config.schema import SequenceParallelConfig

__all__ = ["SequenceAttention", "ULYSSES"]


@dataclass(frozen=True)
class SequenceAttention:
    """The mode of a job's sequence parallelism."""

    #: True: keys and values travel round the group (sequence/ring.py); False: Ulysses' all-to-alls
    ring: bool = False
    #: with ``ring``: whether a position attends only to itself and the positions before it
    causal: bool = True
    #: with ``ring``: head-tail sharding (see [Note: head-tail sharding balances the causal ring] in
    #: sequence/ring.py)
    balanced: bool = False

    @staticmethod
    def from_config(block: SequenceParallelConfig) -> "SequenceAttention":
        return SequenceAttention(ring=block.mode == "ring", causal=block.causal, balanced=block.load_balance)


#: the default, and the mode of a group with no engine behind it
ULYSSES = SequenceAttention()
