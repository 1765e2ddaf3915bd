"""Sequence parallelism (docs/SEQUENCE_PARALLEL.md): every sequence split across the ranks of a
sequence-parallel group; DeepSpeed-Ulysses computes attention on a share of the heads over whole sequences
(layer.py: ``DistributedAttention``, DeepSpeed's ``deepspeed.sequence.layer``) with the all-to-all that
trades one split for the other (all_to_all.py), or a ring passes the keys and values round the group
(ring.py; the config's mode: policy.py); the live engine's groups (groups.py).  The Hugging Face path
(DeepSpeed's ALST): transformers' attention wrapped in the exchange (hf.py) or replaced by the ring
(hf_ring.py), the groups made before the engine (unit.py), each batch cut over the group (loader.py), the
loss over the group's counted tokens (loss.py), and computations tiled along the sequence (tiled.py)."""

from .all_to_all import sequence_all_to_all
from .groups import SequenceParallelError, check_sequence_axes, live_sequence_groups
from .layer import DistributedAttention
from .hf import UlyssesSPAttentionHF, restore_transformers_attention
from .loader import UlyssesSPDataLoaderAdapter
from .loss import combine_sequence_losses, sequence_loss
from .ring import sequence_positions
from .tiled import TiledMLP, sequence_tiled_compute
from .unit import SequenceParallelUnit

__all__ = ["DistributedAttention", "SequenceParallelError", "sequence_all_to_all", "check_sequence_axes",
           "live_sequence_groups", "sequence_positions", "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter",
           "restore_transformers_attention", "sequence_loss", "combine_sequence_losses", "SequenceParallelUnit",
           "TiledMLP", "sequence_tiled_compute"]
