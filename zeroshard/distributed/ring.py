"""Reduce-scatter and all-gather as rings of point-to-point messages, for gloo.

[Note: gloo's collectives as rings]
In ring arithmetic an all-reduce is a reduce-scatter followed by an all-gather, which is why ZeRO
stages 1-2 communicate what DDP does.  gloo's own reduce-scatter and all-gather do not keep that
promise: measured on one 45.7 MB bucket at world 2 (benchmarks/bench_collectives.py), its all-reduce
took 47 ms, its reduce-scatter 61 ms (list form, in pieces; 100 ms as the tensor form) and its
all-gather 46 ms (87 ms as the tensor form), so a stage-1/2 step spent 2.2x DDP's time in collectives
(both flatten their inputs into temporaries, and gloo's algorithms for them are not the ring).  Sent
as the ring's messages (``isend``/``irecv`` to the neighbours, N-1 steps of one chunk each), the same
reduce-scatter took 35-44 ms and the all-gather 29-40 ms here (a bare exchange without the per-piece
add: 25-28 and 21-25 ms, about one all-reduce together, as the arithmetic says).

- All-gather: at step s a rank sends chunk (r - s) to its right neighbour and receives chunk
  (r - s - 1) from its left one, straight into the output: no temporary at all.
- Reduce-scatter: at step s a rank sends its partial sum of chunk (r - s - 1) and receives the left
  neighbour's partial sum of chunk (r - s - 2), which it adds into its own; after N-1 steps chunk r
  holds the whole sum.  The partial sums are written into the input's chunks (the input is scratch:
  zeroshard reduces a bucket in place and reads only its own chunk), and what is received arrives in
  pieces into two temporaries of ``temporary_bytes`` together, so that the transient is two pieces
  whatever the bucket's size (see [Note: gloo's whole-buffer copies] in collectives.py).

A collective launches its first step's messages and returns; the rest (each step needs the one
before, and a received piece must be added before its temporary is reused) runs in ``wait()``.
Every message carries a tag of its own, drawn from a count kept per process group, so that two
collectives in flight between the same two ranks cannot take each other's messages; the count
advances identically on every rank because every rank issues its collectives in the same order.
"""

from __future__ import annotations

import datetime
import itertools
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

from .world import World

#: messages one collective may tag (the tag's low bits); more reuse tags, matched in order of posting
_TAGS_PER_COLLECTIVE = 1 << 12
#: collectives counted before the tags wrap round (tags stay below 2**31, as gloo needs)
_COLLECTIVE_TAG_ROUNDS = 1 << 19
#: pieces of a reduce-scatter being received at once, each into a temporary of its own
RECEIVES_IN_FLIGHT = 2
#: collectives started, per process group, weakly (a destroyed group is not kept alive; one created
#: again counts from 0 on every rank, as all ranks create it)
_sequences: "weakref.WeakKeyDictionary[Any, itertools.count[int]]" = weakref.WeakKeyDictionary()


def _next_base_tag(world: World) -> int:
    group = world.group if world.group is not None else dist.group.WORLD
    count = _sequences.setdefault(group, itertools.count())
    return (next(count) % _COLLECTIVE_TAG_ROUNDS) * _TAGS_PER_COLLECTIVE


class _Ring:
    """What both rings share: the neighbours, tagged messages, and the works still to be waited for."""

    def __init__(self, world: World, full: torch.Tensor, chunk: int) -> None:
        self.world = world
        self.full = full
        self.chunk = chunk
        self.rank, self.size = world.rank, world.world_size
        self.right, self.left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self._base_tag = _next_base_tag(world)
        self._sends: list[Any] = []

    def part(self, index: int, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """Elements [lo, hi) of chunk ``index`` (of the ring, mod N) of the full buffer."""
        start = (index % self.size) * self.chunk
        return self.full[start + lo: start + (self.chunk if hi is None else hi)]

    def _tag(self, message: int) -> int:
        return self._base_tag + message % _TAGS_PER_COLLECTIVE

    def send(self, tensor: torch.Tensor, message: int) -> None:
        """Message number ``message`` of this collective to the right neighbour, which receives it as the
        same number from its left."""
        self._sends.append(dist.isend(tensor, group=self.world.group, group_dst=self.right, tag=self._tag(message)))

    def receive(self, tensor: torch.Tensor, message: int) -> Any:
        return dist.irecv(tensor, group=self.world.group, group_src=self.left, tag=self._tag(message))

    def wait_sends(self, timeout: Optional[datetime.timedelta]) -> None:
        while self._sends:
            _wait(self._sends.pop(0), timeout)


class RingAllGather(_Ring):
    """Every rank's ``shard`` into ``full`` (N equal chunks), received in place (see the Note)."""

    def __init__(self, world: World, full: torch.Tensor, shard: torch.Tensor) -> None:
        super().__init__(world, full, shard.numel())
        own = self.part(self.rank)
        if own.data_ptr() != shard.data_ptr():
            own.copy_(shard)
        self._step = 0
        self._receiving = self._launch_step()

    def _launch_step(self) -> Any:
        self.send(self.part(self.rank - self._step), self._step)
        return self.receive(self.part(self.rank - self._step - 1), self._step)

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        while True:
            _wait(self._receiving, timeout)
            self._step += 1
            if self._step == self.size - 1:
                break
            self._receiving = self._launch_step()
        self.wait_sends(timeout)
        return True


class RingReduceScatter(_Ring):
    """The sum over ranks of ``full``'s chunk r into ``output`` (``full`` is scratch; see the Note)."""

    def __init__(self, world: World, full: torch.Tensor, output: torch.Tensor, temporary_bytes: int) -> None:
        super().__init__(world, full, output.numel())
        self.output = output
        piece = temporary_bytes // (RECEIVES_IN_FLIGHT * full.element_size())  # the temporaries together
        self.piece = max(1, min(piece, self.chunk))
        self._temps = [torch.empty(self.piece, dtype=full.dtype, device=full.device)
                       for _ in range(min(RECEIVES_IN_FLIGHT, -(-self.chunk // self.piece)))]
        self._pending: list[tuple[int, tuple[int, int]]] = []  # pieces of this step not yet received
        self._ranges = [(lo, min(self.chunk, lo + self.piece)) for lo in range(0, self.chunk, self.piece)]
        self._step = 0
        self._receiving: list[tuple[Any, int, int, torch.Tensor]] = []  # (work, lo, hi, temporary)
        self._launch_step()

    def _message(self, piece_index: int) -> int:
        return self._step * len(self._ranges) + piece_index

    def _launch_step(self) -> None:
        for i, (lo, hi) in enumerate(self._ranges):
            self.send(self.part(self.rank - self._step - 1, lo, hi), self._message(i))
        self._pending = list(enumerate(self._ranges))
        for temp in self._temps:
            self._receive_next(temp)

    def _receive_next(self, temp: torch.Tensor) -> None:
        if self._pending:
            i, (lo, hi) = self._pending.pop(0)
            self._receiving.append((self.receive(temp[:hi - lo], self._message(i)), lo, hi, temp))

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        while True:
            last = self._step == self.size - 2
            index = self.rank - self._step - 2  # the chunk being received this step (r itself at the last)
            while self._receiving:
                work, lo, hi, temp = self._receiving.pop(0)
                _wait(work, timeout)
                received = temp[:hi - lo]
                if last:
                    torch.add(self.part(index, lo, hi), received, out=self.output[lo:hi])
                else:
                    self.part(index, lo, hi).add_(received)
                self._receive_next(temp)
            if last:
                break
            self.wait_sends(timeout)  # not for correctness (no step writes a chunk sent before): few works held
            self._step += 1
            self._launch_step()
        self.wait_sends(timeout)
        self._temps = []
        return True


def _wait(work: Any, timeout: Optional[datetime.timedelta]) -> None:
    work.wait() if timeout is None else work.wait(timeout=timeout)
