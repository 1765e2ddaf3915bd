"""``deepspeed.runtime.zero.muon``: DeepSpeed's Muon, zeroshard's whole-matrix Muon (optim/muon.py)."""

from .muon_optimizer import MuonWithAuxAdam

__all__ = ["MuonWithAuxAdam"]
