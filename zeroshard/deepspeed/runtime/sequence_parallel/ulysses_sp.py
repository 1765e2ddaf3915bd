"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: ``UlyssesSPAttentionHF`` (zeroshard/sequence/hf.py),
``UlyssesSPDataLoaderAdapter`` (zeroshard/sequence/loader.py), ``TiledMLP`` and ``sequence_tiled_compute``
(zeroshard/sequence/tiled.py) under DeepSpeed's path; the loss over the group's counted tokens is
zeroshard's ``sequence_loss`` (zeroshard/sequence/loss.py)."""

from ....sequence.hf import UlyssesSPAttentionHF
from ....sequence.loader import UlyssesSPDataLoaderAdapter
from ....sequence.loss import combine_sequence_losses, sequence_loss
from ....sequence.tiled import TiledMLP, sequence_tiled_compute

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "TiledMLP", "sequence_tiled_compute", "sequence_loss",
           "combine_sequence_losses"]
