"""The one thin layer every zeroshard collective goes through.

Each call is labelled for the profiler (``zeroshard.<kind>.<label>``) and counted: calls, bytes this
rank sends and receives, and seconds spent blocked.  Communication volume is then a measurable,
testable fact rather than a claim.

[Note: byte model]
Bytes are counted with the bandwidth-optimal (ring) algorithm that NCCL and gloo use for large
messages.  For a collective over ``B`` bytes of full (unsharded) data and ``N`` ranks, each rank sends
and receives ``(N-1)/N * B`` for a reduce-scatter or an all-gather, and twice that for an all-reduce
(which is a reduce-scatter followed by an all-gather).  Broadcast counts ``B`` received on every rank
but the source, and ``B`` sent by the source.  A world of one rank moves nothing.  zeroshard pads its
buffers to a multiple of ``N`` elements, so these figures are whole numbers of bytes.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .world import World


# torch 2.13 renamed the tensor forms of these collectives; keep working on the older releases too.
_reduce_scatter_1d = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_1d = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommKind(str, Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"


@dataclass
class CommCounter:
    """What one kind of collective has cost this rank so far."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it (a sign that ranks diverged)."""


class PendingCollective:
    """A collective in flight: ``wait()`` blocks until it is done and accounts the time."""

    def __init__(self, work: Optional[Any], label: str, counter: CommCounter, timeout_s: float = 1800.0) -> None:
        self._work = work
        self.label = label
        self._counter = counter
        self._timeout = datetime.timedelta(seconds=timeout_s)

    def wait(self) -> None:
        if self._work is None:
            return
        start = time.perf_counter()
        try:
            # The config's timeout applies even to a process group created elsewhere (torchrun users,
            # test harnesses) with a longer default.
            self._work.wait(timeout=self._timeout)
        except Exception as err:  # gloo and NCCL raise RuntimeError subclasses on timeout
            raise CollectiveError(f"collective {self.label!r} failed: {err}. If ranks diverged (a rank "
                                  f"skipped a module or ran out of data), fix that; the timeout is "
                                  f"config key 'collective_timeout'.") from err
        finally:
            self._counter.seconds += time.perf_counter() - start
            self._work = None


class Collectives:
    """Labelled, counted collectives over one :class:`World`."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.counters: dict[CommKind, CommCounter] = {kind: CommCounter() for kind in CommKind}

    def reset_counters(self) -> None:
        self.counters = {kind: CommCounter() for kind in CommKind}

    def total_bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.counters.values())

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {k.value: vars(c).copy() for k, c in self.counters.items()}

    def _account(self, kind: CommKind, full_bytes: int, factor: int) -> CommCounter:
        counter = self.counters[kind]
        counter.calls += 1
        n = self.world.world_size
        moved = factor * (n - 1) * full_bytes // n
        counter.bytes_sent += moved
        counter.bytes_received += moved
        return counter

    def _run(self, kind: CommKind, label: str, counter: CommCounter, launch: Any, async_op: bool) -> PendingCollective:
        if not self.world.is_distributed:
            return PendingCollective(None, label, counter)
        start = time.perf_counter()
        with record_function(f"zeroshard.{kind.value}.{label}"):
            try:
                work = launch()
            except Exception as err:
                raise CollectiveError(f"collective {label!r} could not start: {err}") from err
        counter.seconds += time.perf_counter() - start
        pending = PendingCollective(work, label, counter, self.world.timeout_s)
        if not async_op:
            pending.wait()
        return pending

    def all_reduce(self, tensor: torch.Tensor, label: str, async_op: bool = False,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> PendingCollective:
        """Sum (or ``op``) ``tensor`` in place across ranks."""
        counter = self._account(CommKind.ALL_REDUCE, _nbytes(tensor), 2)
        return self._run(CommKind.ALL_REDUCE, label, counter,
                         lambda: dist.all_reduce(tensor, op=op, group=self.world.group, async_op=True), async_op)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, label: str,
                       async_op: bool = False) -> PendingCollective:
        """Sum ``full`` (1D, N equal chunks) across ranks; this rank's chunk lands in ``output``."""
        counter = self._account(CommKind.REDUCE_SCATTER, _nbytes(full), 1)
        if not self.world.is_distributed:
            output.copy_(full)
        return self._run(CommKind.REDUCE_SCATTER, label, counter,
                         lambda: _reduce_scatter_1d(output, full, group=self.world.group, async_op=True),
                         async_op)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, label: str,
                   async_op: bool = False) -> PendingCollective:
        """Concatenate every rank's ``shard`` into ``full`` (1D, N equal chunks)."""
        counter = self._account(CommKind.ALL_GATHER, _nbytes(full), 1)
        if not self.world.is_distributed and shard.data_ptr() != full.data_ptr():
            full.copy_(shard)
        return self._run(CommKind.ALL_GATHER, label, counter,
                         lambda: _all_gather_1d(full, shard, group=self.world.group, async_op=True),
                         async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, label: str) -> None:
        """Copy rank ``src``'s ``tensor`` into every rank's."""
        counter = self.counters[CommKind.BROADCAST]
        counter.calls += 1
        if self.world.is_distributed:
            if self.world.rank == src:
                counter.bytes_sent += _nbytes(tensor)
            else:
                counter.bytes_received += _nbytes(tensor)
        self._run(CommKind.BROADCAST, label, counter,
                  lambda: dist.broadcast(tensor, src=src, group=self.world.group, async_op=True), False)

    def all_reduce_scalar(self, value: float, label: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> float:
        """All-reduce one float64 (e.g. a squared gradient norm); counted like any all-reduce."""
        t = torch.tensor([value], dtype=torch.float64, device=self.world.device)
        self.all_reduce(t, label, op=op)
        return float(t.item())


    def all_gather_json(self, value: Any, label: str) -> list[Any]:
        """Every rank's ``value`` (small, JSON-serialisable metadata), in rank order; counted bytes."""
        if not self.world.is_distributed:
            return [value]
        raw = json.dumps(value).encode()
        longest = int(self.all_reduce_scalar(len(raw), f"{label}.size", op=dist.ReduceOp.MAX))
        mine = torch.zeros(longest, dtype=torch.uint8, device=self.world.device)
        mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        full = torch.empty(longest * self.world.world_size, dtype=torch.uint8, device=self.world.device)
        self.all_gather(full, mine, label)
        rows = full.view(self.world.world_size, longest).cpu()
        return [json.loads(bytes(row.tolist()).rstrip(b"\0")) for row in rows]  # JSON never holds a NUL

    def broadcast_json(self, value: Any, src: int, label: str) -> Any:
        """Rank ``src``'s ``value`` (JSON-serialisable) on every rank."""
        if not self.world.is_distributed:
            return value
        raw = json.dumps(value).encode() if self.world.rank == src else b""
        size = int(self.all_reduce_scalar(len(raw), f"{label}.size"))
        buffer = torch.zeros(size, dtype=torch.uint8, device=self.world.device)
        if raw:
            buffer.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        self.broadcast(buffer, src, label)
        return json.loads(bytes(buffer.cpu().tolist()))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
