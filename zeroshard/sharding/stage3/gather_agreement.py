"""Every rank gathers the same stage-3 units in the same order, whatever modules its inputs use.

[Note: ranks agree on every gather]
Stage 3 gathers a unit when its module is about to compute.  Which modules compute can depend on the
data: mixture-of-experts routing, a layer dropped at random, a head used for some inputs only.  Left
alone, one rank would all-gather an expert that the other rank skips, and the two would wait on
each other forever, or pair one unit's gather with another's and go on with wrong values.

So a rank never issues a pass's gather on its own.  When it needs a unit that is not gathered, it
enters a *round*: every rank all-gathers a small row on a gloo group of its own (host memory, never
paired with a ZeRO collective), saying which units it needs now and which it would prefetch, and
every rank then gathers the union of the rows, in the rows' order.  A rank that needs nothing
yet is not in a round; the others wait for it there, as they would wait in the all-gather.  A rank
that ends its forward or backward answers rounds, asking for nothing, until every rank has ended it
(:meth:`GatherAgreement.finish`): only then may it go on to the next call, whose consistency check
runs on another group.  A unit gathered for another rank's sake is released at once, and a rank that
has a unit gathered already still takes part in the all-gather (:meth:`ShardedParameters.join_gather`).

Ranks whose modules run alike ask for the same units in the same rounds, so the rounds cost one small
host-side all-gather per unit that prefetch did not bring in time, and one per use of a unit whose
successor in the recorded order is not on its way yet (prefetch happens inside rounds only, and the
next unit is always prefetched: [Note: the next unit is always prefetched] in
sharding/stage3/gather_scheduler.py).  Gradient reduce-scatters run on a group of their own
(``ShardGroups.grads``), so that a rank reducing a bucket while another gathers never pairs the two;
their order is the bucket order on every rank ([Note: launching buckets in order] in
sharding/strategy.py).  Two more rules keep a rank from
waiting on another that waits for it in a round: parameters that the backward graph does not reach
count as arrived from its start (:func:`parameters_reached`, as DDP's ``find_unused_parameters``),
so a rank that skipped a module reduces its bucket when the others do; and until every rank's
backward is over, backward never blocks on a reduction (``ShardingStrategy.may_block``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ...distributed.collectives import Collectives

#: units one row can ask for: the one needed now, then the ones to prefetch
ROW_WIDTH = 16
_NOTHING = -1
_DONE = -2


class GatherAgreement:
    """The rounds of [Note: ranks agree on every gather], over a gloo group of their own."""

    def __init__(self, rounds: Collectives) -> None:
        """``rounds``: a gloo group of every rank of the job (``ShardGroups.rounds``).  Rounds run over
        all of them even where the state is sharded over smaller groups (MiCS): each group then gathers
        the union of every rank's requests, the same units on each of its ranks."""
        self.comm = rounds
        self.rounds = 0

    def _round(self, row: Sequence[int]) -> list[list[int]]:
        world = self.comm.world
        mine = torch.full((ROW_WIDTH,), _NOTHING, dtype=torch.int64)
        mine[: len(row)] = torch.tensor(list(row)[:ROW_WIDTH], dtype=torch.int64)
        table = torch.empty(world.world_size * ROW_WIDTH, dtype=torch.int64)
        self.comm.all_gather_rows(table, mine, "gather_agreement")
        self.rounds += 1
        return table.view(world.world_size, ROW_WIDTH).tolist()

    def request(self, wanted: Sequence[int]) -> list[int]:
        """One round: this rank asks for ``wanted`` (needed unit first); every rank must gather the
        returned units, the union of every rank's request, in the returned order."""
        return _union(self._round(wanted))

    def finish(self, gather_for_others: Callable[[list[int]], None]) -> None:
        """This rank's pass is over: answer the others' rounds until every rank's pass is over."""
        while True:
            table = self._round([_DONE])
            if all(row[0] == _DONE for row in table):
                return
            gather_for_others(_union(table))


def _union(table: list[list[int]]) -> list[int]:
    """Every unit asked for, each once, in the order of the rows and within each row: the same on every
    rank, and where the ranks ask alike, the needed unit first and the prefetches in the order they
    will be used (a group runs its gathers in the order they are issued)."""
    return list(dict.fromkeys(unit for row in table for unit in row if unit >= 0))



def parameters_reached(loss: torch.Tensor) -> "set[int] | None":
    """The ids of the leaf tensors ``loss.backward()`` will accumulate gradients into, from its graph;
    None where a custom autograd function (a reentrant checkpoint) may hide some."""
    found: set[int] = set()
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "BackwardCFunction" or "CheckpointFunction" in type(node).__name__:
            return None
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return found
