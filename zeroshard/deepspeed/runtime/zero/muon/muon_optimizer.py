"""``deepspeed.runtime.zero.muon.muon_optimizer``: ``MuonWithAuxAdam``, parameter groups marked
``use_muon`` (see [Note: DeepSpeed's Muon split] in optim/muon.py)."""

from .....optim.muon import MuonWithAuxAdam

__all__ = ["MuonWithAuxAdam"]
