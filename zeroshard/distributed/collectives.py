"""The one thin layer every zeroshard collective goes through.

Each call is labelled for the profiler (``zeroshard.<kind>.<label>``) and counted: calls, bytes this
rank sends and receives, and seconds spent blocked.  Communication volume is then a measurable,
testable fact rather than a claim.

[Note: byte model]
Bytes are counted with the bandwidth-optimal (ring) algorithm that NCCL and gloo use for large
messages.  For a collective over ``B`` bytes of full (unsharded) data and ``N`` ranks, each rank sends
and receives ``(N-1)/N * B`` for a reduce-scatter or an all-gather, and twice that for an all-reduce
(which is a reduce-scatter followed by an all-gather).  A ring step (``send_recv``) counts what it
sends to the next rank and receives from the previous one.  Broadcast counts ``B`` received on every rank
but the source, and ``B`` sent by the source.  A world of one rank moves nothing.  zeroshard pads its
buffers to a multiple of ``N`` elements, so these figures are whole numbers of bytes.

[Note: inside and across nodes]
Every collective runs over one group (the whole world, or a hybrid-sharding group of
:mod:`.topology`).  Its bytes are also counted by *scope*: inside one node when every rank of the
group is on the same node, across nodes otherwise, wholly: a ring over ranks on several nodes runs at
the speed of its slowest link, the network, whatever share of its hops stay inside a node.  The
collectives of all groups of one engine share one :class:`CommLedger`.
"""

from __future__ import annotations

import datetime
import json
import time
import zlib
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .ring import RingAllGather, RingReduceScatter, _next_base_tag
from .ring_progress import RING_PROGRESS, DrivenRing, Ring
from .world import World


# torch 2.13 renamed the tensor forms of these collectives; keep working on the older releases too.
reduce_scatter_1d = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_1d = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommScope(str, Enum):
    """Where a collective's bytes travel (see [Note: inside and across nodes])."""

    INSIDE_NODE = "inside_node"
    ACROSS_NODES = "across_nodes"


class CommKind(str, Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"


@dataclass
class CommCounter:
    """What one kind of collective has cost this rank so far."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class CallRecord:
    """One collective, as :meth:`CommLedger.start_log` records it."""

    kind: CommKind
    label: str
    group_size: int
    scope: CommScope
    full_bytes: int  # the whole (unsharded) data of the collective
    sent: int  # bytes this rank sent


class LaunchGate:
    """What must pass before the next collective of an engine is launched, on any of its groups: a
    consistency check still in flight (see [Note: the backward's check runs behind its compute] in
    distributed/consistency.py).  Collectives that share a gate share it across threads too: autograd
    runs a GPU backward's hooks on a thread of its own."""

    def __init__(self) -> None:
        self._before: Optional[Callable[[], None]] = None

    def hold(self, before: Callable[[], None]) -> None:
        """Run ``before`` once, before the next collective is launched (it may raise instead)."""
        self._before = before

    def clear(self) -> None:
        self._before = None

    def open(self) -> None:
        before, self._before = self._before, None
        if before is not None:
            before()


class CommLedger:
    """What the collectives of one engine (every group of it) have cost this rank so far."""

    def __init__(self, gate: Optional[LaunchGate] = None) -> None:
        #: passed before each launch: shared with groups counted apart but launched by the same engine
        self.gate = gate or LaunchGate()
        self.counters: dict[CommKind, CommCounter] = {kind: CommCounter() for kind in CommKind}
        #: bytes sent, by scope (every kind together)
        self.sent_by_scope: dict[CommScope, int] = {scope: 0 for scope in CommScope}
        #: every collective since :meth:`start_log` (None: not recording)
        self.log: Optional[list[CallRecord]] = None
        #: per process group, a digest of the sequence of collectives issued on it: kind and size, in
        #: order (see [Note: the consistency check] in distributed/consistency.py)
        self._sequence: dict[int, int] = {}

    def start_log(self) -> list[CallRecord]:
        """Record every collective from now on (tests and benchmarks check them one by one)."""
        self.log = []
        return self.log

    def record(self, kind: CommKind, label: str, world: World, scope: CommScope, full_bytes: int, sent: int) -> None:
        self.sent_by_scope[scope] += sent
        group = id(world.group)
        self._sequence[group] = zlib.crc32(f"{kind.value}:{full_bytes};".encode(), self._sequence.get(group, 0))
        if self.log is not None:
            self.log.append(CallRecord(kind, label, world.world_size, scope, full_bytes, sent))

    def sequence_digest(self) -> int:
        """One number for the order of the collectives on each group (the groups' orders relative to
        each other do not count: they overlap differently from rank to rank)."""
        return sum(self._sequence.values()) % (1 << 62)

    def reset(self) -> None:
        """Zero every count in place (every :class:`Collectives` sharing the ledger sees it)."""
        self._sequence.clear()
        for kind in CommKind:
            self.counters[kind] = CommCounter()
        for scope in CommScope:
            self.sent_by_scope[scope] = 0


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it (a sign that ranks diverged)."""


class PendingCollective:
    """A collective in flight: ``wait()`` makes its result usable and accounts the time.

    [Note: waiting on a device collective]
    A host collective (gloo, or zeroshard's rings over it) is waited for on the host, with the
    config's ``collective_timeout``: it applies even to a process group created elsewhere (torchrun
    users, test harnesses) with a longer default, and a rank that never joins fails the wait with a
    :class:`CollectiveError` naming the collective.  A device collective (NCCL, tensors on the GPU) is
    waited for with no timeout: NCCL's ``wait()`` then only makes the current CUDA stream wait for the
    collective's stream and returns at once, whereas a wait *with* a timeout polls on the host until the
    GPU has finished, which would stall the host at every bucket, unit and post-step gather and leave
    nothing queued ahead of the GPU.  A device collective is bounded by the process group's own timeout
    instead, which NCCL's watchdog enforces: a hung NCCL collective ends the process with the
    watchdog's error (torch's ``TORCH_NCCL_ASYNC_ERROR_HANDLING``), not with a :class:`CollectiveError`.
    ``init_distributed`` creates the group with ``collective_timeout``; a group created elsewhere keeps
    its own timeout.
    """

    def __init__(self, work: Optional[Any], label: str, counter: CommCounter, timeout_s: float = 1800.0,
                 on_device: bool = False) -> None:
        self._work = work
        self.label = label
        self._counter = counter
        #: None: a device collective, waited for without a host timeout (see the note above)
        self._timeout: Optional[datetime.timedelta] = None if on_device else datetime.timedelta(seconds=timeout_s)

    def is_completed(self) -> bool:
        """Whether the collective has finished (``wait()`` would not block): it runs on without one."""
        return self._work is None or bool(self._work.is_completed())

    def wait(self) -> None:
        if self._work is None:
            return
        start = time.perf_counter()
        try:
            if self._timeout is None:  # a device collective: the stream waits, not the host
                self._work.wait()
            else:
                self._work.wait(timeout=self._timeout)
        except Exception as err:  # gloo and NCCL raise RuntimeError subclasses on timeout
            raise CollectiveError(f"collective {self.label!r} failed: {err}. If ranks diverged (a rank "
                                  f"skipped a module or ran out of data), fix that; the timeout is "
                                  f"config key 'collective_timeout'.") from err
        finally:
            self._counter.seconds += time.perf_counter() - start
            self._work = None


class Collectives:
    """Labelled, counted collectives over one :class:`World` (one process group)."""

    def __init__(self, world: World, ledger: Optional[CommLedger] = None) -> None:
        self.world = world
        self.ledger = ledger or CommLedger()

    @property
    def scope(self) -> CommScope:
        return CommScope.ACROSS_NODES if self.world.spans_nodes else CommScope.INSIDE_NODE

    @property
    def counters(self) -> dict[CommKind, CommCounter]:
        return self.ledger.counters

    def over(self, world: World) -> "Collectives":
        """Collectives over another group (a hybrid-sharding group), counted in this ledger."""
        return Collectives(world, self.ledger)

    def reset_counters(self) -> None:
        self.ledger.reset()

    def bytes_sent_by_scope(self) -> dict[str, int]:
        """Bytes this rank sent inside its node and across nodes (see [Note: inside and across nodes])."""
        return {scope.value: sent for scope, sent in self.ledger.sent_by_scope.items()}

    def total_bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.counters.values())

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {k.value: vars(c).copy() for k, c in self.counters.items()}

    def _account(self, kind: CommKind, full_bytes: int, factor: int, label: str) -> CommCounter:
        counter = self.counters[kind]
        counter.calls += 1
        n = self.world.world_size
        moved = factor * (n - 1) * full_bytes // n
        counter.bytes_sent += moved
        counter.bytes_received += moved
        self.ledger.record(kind, label, self.world, self.scope, full_bytes, moved)
        return counter

    def _run(self, kind: CommKind, label: str, counter: CommCounter, launch: Any, async_op: bool,
             tensor: torch.Tensor) -> PendingCollective:
        """Launch a collective over ``tensor`` (one of its tensors: where they live decides how it is
        waited for, see [Note: waiting on a device collective])."""
        if not self.world.is_distributed:
            return PendingCollective(None, label, counter)
        self.ledger.gate.open()
        start = time.perf_counter()
        with record_function(f"zeroshard.{kind.value}.{label}"):
            try:
                work = launch()
            except Exception as err:
                raise CollectiveError(f"collective {label!r} could not start: {err}") from err
        counter.seconds += time.perf_counter() - start
        pending = PendingCollective(work, label, counter, self.world.timeout_s,
                                    on_device=tensor.device.type != "cpu")
        if not async_op:
            pending.wait()
        return pending

    def all_reduce(self, tensor: torch.Tensor, label: str, async_op: bool = False,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> PendingCollective:
        """Sum (or ``op``) ``tensor`` in place across ranks."""
        counter = self._account(CommKind.ALL_REDUCE, _nbytes(tensor), 2, label)
        return self._run(CommKind.ALL_REDUCE, label, counter,
                         lambda: dist.all_reduce(tensor, op=op, group=self.world.group, async_op=True), async_op,
                         tensor)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, label: str, async_op: bool = False,
                       own_input: Optional[torch.Tensor] = None) -> PendingCollective:
        """Sum ``full`` (1D, N equal chunks) across ranks; this rank's chunk lands in ``output``.  ``full``
        is scratch: on gloo the ring writes partial sums into it (see ring.py).

        ``own_input``: this rank's own chunk of the input, when it lives outside ``full`` (``output``
        itself, for a sum that accumulates in place): ``full``'s own chunk is then neither read nor
        written on gloo, so its pages are never touched (see [Note: stage 2's own chunk is reduced in
        place] in sharding/grad_chunks.py).  Other backends reduce the whole of ``full``: the own chunk is
        copied into it first."""
        counter = self._account(CommKind.REDUCE_SCATTER, _nbytes(full), 1, label)
        if not self.world.is_distributed:
            source = full if own_input is None else own_input
            if source.data_ptr() != output.data_ptr():
                output.copy_(source)
        if self._rings:
            return self._run(CommKind.REDUCE_SCATTER, label, counter,
                             lambda: self._driven(RingReduceScatter(self.world, full, output, PIECE_BYTES, own_input)),
                             async_op, full)
        if own_input is not None and self.world.is_distributed:
            chunk = full.numel() // self.world.world_size
            full[self.world.rank * chunk: (self.world.rank + 1) * chunk].copy_(own_input)
        return self._run(CommKind.REDUCE_SCATTER, label, counter,
                         lambda: reduce_scatter_1d(output, full, group=self.world.group, async_op=True),
                         async_op, full)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, label: str,
                   async_op: bool = False) -> PendingCollective:
        """Concatenate every rank's ``shard`` into ``full`` (1D, N equal chunks).  ``shard`` must not change
        until the gather is waited for: on gloo the ring sends from it (see ring.py)."""
        counter = self._account(CommKind.ALL_GATHER, _nbytes(full), 1, label)
        if not self.world.is_distributed and shard.data_ptr() != full.data_ptr():
            full.copy_(shard)
        if self._rings:
            return self._run(CommKind.ALL_GATHER, label, counter,
                             lambda: self._driven(RingAllGather(self.world, full, shard, PIECE_BYTES)), async_op,
                             full)
        return self._run(CommKind.ALL_GATHER, label, counter,
                         lambda: all_gather_1d(full, shard, group=self.world.group, async_op=True),
                         async_op, full)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, label: str) -> None:
        """Rank r's ``output`` gets chunk r of every rank's ``input``, in rank order (equal chunks along
        the first dimension); each rank keeps its own chunk, so it sends (N-1)/N of ``input``."""
        counter = self._account(CommKind.ALL_TO_ALL, _nbytes(input), 1, label)
        if not self.world.is_distributed:
            output.copy_(input)
        self._run(CommKind.ALL_TO_ALL, label, counter,
                  lambda: dist.all_to_all_single(output, input, group=self.world.group, async_op=True), False,
                  input)

    def count_all_to_all(self, input_bytes: int, label: str) -> CommCounter:
        """Account, on the launching thread, an all-to-all of ``input_bytes`` per rank that a job on a
        progress thread runs later (:meth:`exchange`), so that the ledger's order is the launch order."""
        self.ledger.gate.open()
        return self._account(CommKind.ALL_TO_ALL, input_bytes, 1, label)

    def exchange(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """An all-to-all counted at launch (:meth:`count_all_to_all`), blocking, for a job on this group's
        progress thread (see [Note: rings progress on their own thread] in distributed/ring_progress.py)."""
        if not self.world.is_distributed:
            output.copy_(input)
            return
        dist.all_to_all_single(output, input, group=self.world.group)

    def drive(self, job: Ring, label: str, counter: CommCounter) -> PendingCollective:
        """Hand ``job`` (whose ``wait`` runs collectives of this group) to the group's progress thread; in
        flight until its ``wait()``."""
        return PendingCollective(self._driven(job), label, counter, self.world.timeout_s)

    def all_to_all_uneven(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                          input_splits: list[int], label: str, total_bytes: int) -> None:
        """Rank r's ``output`` gets, in rank order, the ``output_splits[q]`` elements every rank q sends
        it; this rank sends ``input_splits[d]`` elements of ``input`` to rank d (its own split is 0).
        ``total_bytes``: what every rank together sends, the same number on each (what the consistency
        check compares)."""
        counter = self.counters[CommKind.ALL_TO_ALL]
        counter.calls += 1
        size = input.element_size()
        sent = sum(input_splits) * size if self.world.world_size > 1 else 0
        counter.bytes_sent += sent
        counter.bytes_received += sum(output_splits) * output.element_size() if self.world.world_size > 1 else 0
        self.ledger.record(CommKind.ALL_TO_ALL, label, self.world, self.scope, total_bytes, sent)
        if not self.world.is_distributed:
            output.copy_(input)
            return
        self._run(CommKind.ALL_TO_ALL, label, counter,
                  lambda: dist.all_to_all_single(output, input, output_splits, input_splits,
                                                 group=self.world.group, async_op=True), False, input)

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor, label: str,
                  async_op: bool = False) -> PendingCollective:
        """One step of a ring over the group: ``send`` goes to the next rank (rank + 1, wrapping round)
        while ``recv`` is filled from the previous one; ``send`` must not change until it is waited for."""
        counter = self.counters[CommKind.SEND_RECV]
        counter.calls += 1
        sent = _nbytes(send) if self.world.world_size > 1 else 0
        counter.bytes_sent += sent
        counter.bytes_received += _nbytes(recv) if self.world.world_size > 1 else 0
        self.ledger.record(CommKind.SEND_RECV, label, self.world, self.scope, _nbytes(send), sent)
        if not self.world.is_distributed:
            recv.copy_(send)
        size, rank, group = self.world.world_size, self.world.rank, self.world.group
        # tagged like the rings' messages, so that a collective in flight on the same group keeps its own
        tag = _next_base_tag(self.world) if self.world.is_distributed else 0
        return self._run(CommKind.SEND_RECV, label, counter, lambda: _Works(dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % size, tag=tag),
            dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % size, tag=tag)])), async_op, send)

    def all_gather_rows(self, full: torch.Tensor, row: torch.Tensor, label: str,
                        async_op: bool = False) -> PendingCollective:
        """:meth:`all_gather` of a row of bookkeeping per rank (a few integers), as one collective of
        the backend even on gloo: a ring's messages and its progress thread would cost more than the
        data, whose temporaries are as small (see [Note: gloo's whole-buffer copies])."""
        counter = self._account(CommKind.ALL_GATHER, _nbytes(full), 1, label)
        if not self.world.is_distributed:
            full.copy_(row)
        return self._run(CommKind.ALL_GATHER, label, counter,
                         lambda: all_gather_1d(full, row, group=self.world.group, async_op=True), async_op, full)

    def _driven(self, ring: Ring) -> DrivenRing:
        """A launched ring, carried forward on the progress thread (see [Note: rings progress on their
        own thread] in distributed/ring_progress.py)."""
        return RING_PROGRESS.drive(ring, datetime.timedelta(seconds=self.world.timeout_s), self.world.group)

    @property
    def _rings(self) -> bool:
        """Whether reduce-scatters and all-gathers run as rings of messages (gloo: see [Note: gloo's
        collectives as rings] in distributed/ring.py); NCCL's own are the ring, in place.  A world of
        one that issues its collectives (``collectives_at_one``) has no neighbour: gloo's own then."""
        return self.world.world_size > 1 and self.world.backend == "gloo"

    def broadcast(self, tensor: torch.Tensor, src: int, label: str) -> None:
        """Copy rank ``src``'s ``tensor`` into every rank's."""
        counter = self.counters[CommKind.BROADCAST]
        counter.calls += 1
        sent = 0
        if self.world.is_distributed:
            if self.world.rank == src:
                counter.bytes_sent += _nbytes(tensor)
                sent = _nbytes(tensor)
            else:
                counter.bytes_received += _nbytes(tensor)
        self.ledger.record(CommKind.BROADCAST, label, self.world, self.scope, _nbytes(tensor), sent)
        self._run(CommKind.BROADCAST, label, counter,
                  lambda: dist.broadcast(tensor, group_src=src, group=self.world.group, async_op=True), False, tensor)

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


#: bytes of one message of a gloo ring (see [Note: gloo's collectives as rings] in distributed/ring.py);
#: a reduce-scatter receives into two temporaries of this size
PIECE_BYTES = 2**20

# [Note: gloo's whole-buffer copies]
# gloo runs the tensor forms of reduce-scatter and all-gather through flat temporaries the size of the
# whole buffer, and its list forms through temporaries the size of what they are given.  A bucket can be
# most of a model (DeepSpeed's default bucket size, 5e8 elements, is larger than most models on one
# host), so such a copy would be the largest transient of stages 1 and 2.  On gloo zeroshard therefore
# sends the rings' messages itself (distributed/ring.py): an all-gather receives in place, and a
# reduce-scatter receives into two temporaries of ``PIECE_BYTES`` each.  Temporaries must stay below
# glibc's largest dynamic mmap threshold (32 MiB on 64-bit systems): glibc serves a block at or above
# its threshold with a fresh ``mmap`` and unmaps it when freed, and raises the threshold to a freed
# block's size only below that maximum, so a temporary of 32 MiB or more would be mapped afresh every
# time and every page of it faulted in again, at every piece of every step.  Below the maximum, the
# first temporaries raise the threshold and the later ones reuse the heap.  Both costs are measured in
# benchmarks/RESULTS.md, section "One bucket's collectives".


class _Works:
    """Several works of the backend (a ring step's send and receive), waited for as one."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def wait(self, **timeout: Any) -> None:
        for work in self._works:
            work.wait(**timeout)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
