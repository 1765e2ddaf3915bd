"""How a whole-matrix optimizer's per-parameter state is held in chunks shaped as the parameter, which
is what a checkpoint saves and reshards (see [Note: whole-matrix state in a checkpoint] in
optim/whole_matrices.py).

[Note: factored moments in parameter-shaped chunks]
Adafactor keeps, for a parameter of two or more dimensions, a row moment of shape (..., R, 1) and a
column moment of shape (..., 1, C), and for a vector one moment shaped as it.  A checkpoint cuts
every state into the chunks of the buckets, which only works for tensors shaped as the parameter, so
each factor is saved broadcast over the dimension it was reduced along (the row moment repeated along
each row, the column moment down each column) and read back from its first column or row: exact,
whatever world or stage saves and loads it.  The file holds two parameter-sized tensors for each
such matrix, as Adam's two moments would; training memory keeps the factors.  Adafactor's ``step``
(one count per parameter, the same for every matrix of a bucket, since they are all stepped at
every step) is saved as the bucket's scalar, as Adam's is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class ChunkedState:
    """State tensors shaped as the parameter (Muon's ``momentum_buffer``), saved as they are."""

    names: tuple[str, ...] = ()
    #: the scalar state that counts each parameter's steps (Adafactor's ``step``), else None
    step_key: Optional[str] = None

    def keys(self, shape: Sequence[int]) -> tuple[str, ...]:
        """The state keys a parameter stepped in ``shape`` has."""
        return self.names

    def spread(self, key: str, value: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """State ``key`` of a parameter stepped in ``shape`` as one value per element, 1-D."""
        return value.expand(tuple(shape)).reshape(-1)

    def restore(self, key: str, whole: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """The state tensor from its 1-D spread form ``whole`` (a new tensor)."""
        return whole.view(tuple(shape)).clone()


@dataclass(frozen=True)
class FactoredState(ChunkedState):
    """Adafactor's moments: ``row_var`` and ``col_var`` for two or more dimensions, broadcast to the
    parameter's shape in chunks, ``variance`` for a vector (see [Note: factored moments in
    parameter-shaped chunks])."""

    names: tuple[str, ...] = ("row_var", "col_var", "variance")
    step_key: Optional[str] = "step"

    def keys(self, shape: Sequence[int]) -> tuple[str, ...]:
        return ("row_var", "col_var") if len(shape) >= 2 else ("variance",)

    def restore(self, key: str, whole: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        full = whole.view(tuple(shape))
        if key == "row_var":
            return full[..., :1].clone()
        if key == "col_var":
            return full[..., :1, :].clone()
        return full.clone()
