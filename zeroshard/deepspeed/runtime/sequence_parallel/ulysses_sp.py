"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: ``UlyssesSPAttentionHF`` (zeroshard/sequence/hf.py)
and ``UlyssesSPDataLoaderAdapter`` (zeroshard/sequence/loader.py) under DeepSpeed's path; the loss over
the group's counted tokens is zeroshard's ``sequence_loss`` (zeroshard/sequence/loss.py)."""

from ....sequence.hf import UlyssesSPAttentionHF
from ....sequence.loader import UlyssesSPDataLoaderAdapter
from ....sequence.loss import combine_sequence_losses, sequence_loss

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "sequence_loss", "combine_sequence_losses"]
