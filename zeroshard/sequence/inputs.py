"""The model's inputs on the ranks of a sequence group agree in shape before anything is exchanged.

[Note: a sequence group's inputs are checked before the forward]
Each rank of a sequence group hands the model its own slice of the same samples, and every exchange
of the forward (Ulysses' all-to-alls, the ring's messages) assumes the slices are equal: a rank
holding 6 positions while its neighbour holds 4 makes the backend abort the process (gloo) or hang,
with no word on the cause.  So the engine's forward first gathers, over the sequence group, the shapes
of the tensors the model is given (a few integers per rank, one small collective per micro-step) and
raises :class:`SequenceParallelError` on every rank when they differ, naming each rank's shapes.  A
sequence the degree cannot split is refused where it is cut (``sequence_positions``, the data-loader
adapter); this check catches the slices cut otherwise.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional

import torch

from ..distributed.collectives import Collectives
from .groups import SequenceParallelError

__all__ = ["check_sequence_inputs"]

_DIMS = 4  # the first tensor's leading dimensions, for the message


def _shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    return [(name, tuple(value.shape)) for name, value in named if isinstance(value, torch.Tensor)]


def check_sequence_inputs(comm: Optional[Collectives], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise :class:`SequenceParallelError` on every rank of ``comm``'s sequence group (None: no sequence
    axis, nothing to check) unless each rank's tensor inputs have the same shapes ([Note: a sequence
    group's inputs are checked before the forward])."""
    if comm is None or comm.world.world_size == 1:
        return
    world = comm.world
    shapes = _shapes(args, kwargs)
    first = list(shapes[0][1][:_DIMS]) if shapes else []
    row = torch.tensor([zlib.crc32(repr(shapes).encode()), len(first), *first, *[0] * (_DIMS - len(first))],
                       dtype=torch.int64, device=world.device)
    rows = torch.empty(world.world_size * row.numel(), dtype=torch.int64, device=world.device)
    comm.all_gather_rows(rows, row, "input_shapes_check")
    table = rows.view(world.world_size, -1).tolist()
    if all(r[0] == table[0][0] for r in table):
        return
    held = "; ".join(f"rank {i} of the group: {tuple(r[2:2 + r[1]])}" for i, r in enumerate(table))
    raise SequenceParallelError(
        f"the ranks of a sequence-parallel group hold inputs of different shapes (the first tensor's: {held}); "
        f"each must hold an equal slice of the same samples: cut them with zeroshard.sequence.sequence_positions "
        f"(or DeepSpeed's UlyssesSPDataLoaderAdapter), and pad sequences to a multiple of the degree")
