"""Sequence parallelism (docs/SEQUENCE_PARALLEL.md): every sequence split across the ranks of a
sequence-parallel group; DeepSpeed-Ulysses computes attention on a share of the heads over whole sequences
(layer.py: ``DistributedAttention``, DeepSpeed's ``deepspeed.sequence.layer``) with the all-to-all that
trades one split for the other (all_to_all.py), or a ring passes the keys and values round the group
(ring.py; the config's mode: policy.py); the live engine's groups (groups.py)."""

from .all_to_all import sequence_all_to_all
from .groups import SequenceParallelError, check_sequence_axes, live_sequence_groups
from .layer import DistributedAttention
from .ring import sequence_positions

__all__ = ["DistributedAttention", "SequenceParallelError", "sequence_all_to_all", "check_sequence_axes",
           "live_sequence_groups", "sequence_positions"]
