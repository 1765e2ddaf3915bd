"""Ranks that went different ways are diagnosed before their collectives cross: ``DivergenceError``.

[Note: the consistency check]
Every engine call that issues collectives (forward where the stage gathers, backward, the optimizer
step, checkpoint save and load) first all-gathers one small row per rank: which call this is, the
micro step, the optimizer step, how many collectives the engine has issued, a digest of the
checkpoint tag being saved or loaded, and a digest of the order of the collectives issued on each
group (kind and size).  The last catches ranks that issued the same collectives in different orders
(a reduce-scatter on one rank paired with an all-gather of the same size on another computes
garbage without any error): the next call raises instead of stepping on it.  All ranks issue this same-shaped collective whatever call
they are in, so a rank that skipped a backward, a step or a save meets the others *here*, where the
rows differ and every rank raises the same :class:`DivergenceError` naming the ranks, the step and
what differs, instead of pairing a reduce-scatter with an all-gather (gloo's "Received data size
doesn't match", or a hang until the timeout).  The check runs in a process group of its own (gloo,
on host memory), so that when ranks diverge *inside* a call (a module skipped on one rank at stage
3), a check never pairs with a ZeRO collective of another size (which aborts gloo): the ZeRO
collective then times out with its own named error.  The cost is one all-gather of six integers per call,
counted in its own collectives counters (``ConsistencyCheck.own``), apart from ZeRO's traffic, sent as
one gloo all-gather (``Collectives.all_gather_rows``), not as a ring of messages.

[Note: the backward's check runs behind its compute]
The check is a round trip through every rank, whose latency grows with the ranks (gloo's all-gather is a
ring).  A backward computes for a while before its first collective (a bucket must fill), so its check
is launched at its start and verified just before the first collective any of the engine's groups
launches (the engine's ``LaunchGate``, which the gather rounds of stage 3 share), or at the next check
if the call launches none: a divergent rank still raises before any collective of the divergent call,
and the check's round trip runs while autograd computes.  Every other call is verified at once: a
forward at stage 3 and a step issue their first collective almost at once, and a save or a load must
know before it writes or reads anything.  The verdict comes from the same all-gather on every rank, so
every rank raises, whichever thread (autograd's, on a GPU) verifies it.
"""

from __future__ import annotations

import dataclasses
import zlib
from enum import IntEnum
from typing import Optional

import torch
import torch.distributed as dist

from .collectives import CollectiveError, Collectives, PendingCollective
from .world import new_side_group


class DivergenceError(CollectiveError):
    """Ranks called the engine differently (a skipped backward, step or save on some rank)."""


class EngineUsageError(RuntimeError):
    """The engine was called in an order that cannot be right on any rank (e.g. ``step()`` without
    ``backward()``)."""


class Call(IntEnum):
    FORWARD = 1
    BACKWARD = 2
    STEP = 3
    SAVE = 4
    LOAD = 5


_FIELDS = ("call", "micro step", "optimizer step", "collectives issued", "checkpoint", "order of collectives")


def tag_digest(tag: Optional[str]) -> int:
    return 0 if tag is None else zlib.crc32(tag.encode()) + 1


class ConsistencyCheck:
    """The per-call agreement check of [Note: the consistency check]."""

    def __init__(self, comm: Collectives) -> None:
        self.comm = comm  # the engine's: how many collectives it has issued is one of the fields
        world = comm.world
        if world.is_distributed:  # a group of its own: a check never pairs with a ZeRO collective
            world = dataclasses.replace(world, group=new_side_group(world, backend="gloo"), device=torch.device("cpu"),
                                        backend="gloo")
        #: the check's own traffic, counted apart so that the engine's counters stay ZeRO's traffic
        self.own = Collectives(world)
        #: a check launched and not yet verified, with the rows it gathers into
        self._in_flight: Optional[tuple[PendingCollective, torch.Tensor]] = None

    def release(self) -> None:
        """Drop the side group (at exit, before the process groups are destroyed): no collective, and
        no wait for one (a rank may be gone)."""
        self._in_flight = None
        self.comm.ledger.gate.clear()
        self.own.world = dataclasses.replace(self.own.world, group=None)

    def close(self) -> None:
        """Destroy the side group (``engine.close()``): its sockets go now, not when the process ends,
        so a process that builds engine after engine holds one group at a time."""
        try:
            self.verify()  # every rank launched it: it finishes
        finally:
            group = self.own.world.group
            self.release()
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)

    def agree(self, call: Call, micro_steps: int, global_steps: int, tag: Optional[str] = None,
              behind_compute: bool = False) -> None:
        """All ranks are making the same call at the same point, or every rank raises.

        ``behind_compute``: verified before the engine's next collective instead of at once (see
        [Note: the backward's check runs behind its compute])."""
        world = self.comm.world
        if not world.is_distributed:
            return
        self.verify()  # the previous call's, when it launched no collective
        issued = sum(c.calls for c in self.comm.counters.values())
        mine = torch.tensor([int(call), micro_steps, global_steps, issued, tag_digest(tag),
                             self.comm.ledger.sequence_digest()], dtype=torch.int64)
        rows = torch.empty(world.world_size * mine.numel(), dtype=torch.int64)
        self._in_flight = (self.own.all_gather_rows(rows, mine, "consistency_check", async_op=True), rows)
        if behind_compute:
            self.comm.ledger.gate.hold(self.verify)
        else:
            self.verify()

    def verify(self) -> None:
        """Wait for the check in flight, if any; raise :class:`DivergenceError` if the ranks' rows differ."""
        if self._in_flight is None:
            return
        pending, rows = self._in_flight
        self._in_flight = None
        self.comm.ledger.gate.clear()
        pending.wait()
        table = rows.view(self.comm.world.world_size, -1).tolist()
        if any(row != table[0] for row in table):
            raise DivergenceError(_describe(table, self.comm.world.rank))


def _describe(table: list[list[int]], me: int) -> str:
    differing = [i for i, name in enumerate(_FIELDS) if len({row[i] for row in table}) > 1]
    per_rank = []
    for rank, row in enumerate(table):
        shown = []
        for i in differing:
            value = Call(row[i]).name.lower() if i == 0 else row[i]
            shown.append(f"{_FIELDS[i]} {value}")
        per_rank.append(f"rank {rank}: " + ", ".join(shown))
    step = min(row[2] for row in table)
    if differing == [_FIELDS.index("checkpoint")]:
        verb = "saved" if table[0][0] == Call.SAVE else "loaded"
        return (f"ranks named different checkpoints at optimizer step {step} (seen from rank {me}): "
                + "; ".join(per_rank) + " (digests of the tag, or of the manifest each rank opened). Every rank "
                "must save or load the same checkpoint: check the tag, the directory and its `latest` file on "
                f"every node; nothing was {verb}")
    return (f"ranks diverged at optimizer step {step} (seen from rank {me}): " + "; ".join(per_rank) +
            ". Every rank must call forward/backward/step/save_checkpoint/load_checkpoint the same number "
            "of times with the same checkpoint tag (a rank that skips a batch or a save desynchronises the job)")
