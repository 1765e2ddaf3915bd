"""The all-to-all of DeepSpeed-Ulysses: a tensor split along one dimension over the ranks of a
sequence-parallel group becomes one split along another.

Before the attention each rank holds its slice of the sequence with every head; the exchange scatters
the heads (``scatter_idx``) and gathers the sequence (``gather_idx``), so each rank then holds every
position of its share of the heads.  After the attention the same exchange with the two dimensions
swapped brings the sequence split back.  Rank ``r`` of the group holds the ``r``-th consecutive slice
of the sequence and receives the ``r``-th consecutive share of the heads.
"""

from __future__ import annotations

from torch import Tensor

from ..distributed.collectives import Collectives
from ..distributed.exchange import exchange
from .groups import SequenceParallelError

__all__ = ["sequence_all_to_all"]


def sequence_all_to_all(comm: Collectives, values: Tensor, scatter_idx: int, gather_idx: int, label: str) -> Tensor:
    """``values`` split into ``comm``'s size equal chunks along ``scatter_idx``, chunk ``r`` to rank ``r``,
    and the chunks received concatenated in rank order along ``gather_idx``: the dimension ``scatter_idx``
    shrinks by the group's size and ``gather_idx`` grows by it.  Differentiable: the gradient goes back by
    the inverse exchange (``gather_idx`` scattered, ``scatter_idx`` gathered), the backward of the
    reshapes around the dimension-0 exchange (distributed/exchange.py)."""
    size = comm.world.world_size
    if size == 1:
        return values
    scatter_idx, gather_idx = scatter_idx % values.dim(), gather_idx % values.dim()
    if scatter_idx == gather_idx:
        raise SequenceParallelError(f"scatter_idx and gather_idx are both dimension {scatter_idx}")
    if values.shape[scatter_idx] % size:
        raise SequenceParallelError(
            f"dimension {scatter_idx} of a {tuple(values.shape)} tensor does not split into {size} equal parts "
            f"over the sequence-parallel group")
    # [..., size * part, ...] -> [size, ..., part, ...]: chunk r first, for rank r
    chunks = values.unflatten(scatter_idx, (size, -1)).movedim(scatter_idx, 0)
    received = exchange(comm, chunks, label)  # received[r]: rank r's chunk
    # [size, ..., local, ...] -> [..., size * local, ...], rank 0's part first
    return received.movedim(0, gather_idx).flatten(gather_idx, gather_idx + 1)
