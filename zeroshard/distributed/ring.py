"""Reduce-scatter and all-gather as rings of point-to-point messages, for gloo.

[Note: gloo's collectives as rings]
In ring arithmetic an all-reduce is a reduce-scatter followed by an all-gather, which is why ZeRO stages
1-2 communicate what DDP does.  gloo's own reduce-scatter and all-gather do not keep that promise: both
flatten their inputs into temporaries, and their algorithms are not the ring, so on one bucket together
they take far longer than its all-reduce, and a stage-1/2 step would spend far longer than DDP's in
collectives.  Sent as the ring's messages (``isend``/``irecv`` to the neighbours, N-1 steps of
one chunk each), a reduce-scatter and an all-gather together take about one all-reduce's time.  The
message size matters more than anything else (``piece_bytes``): a piece that fits the cache is received,
added and sent on while it is still there, so zeroshard sends 1 MiB (collectives.PIECE_BYTES), at which
the reduce-scatter is fastest and the all-gather as fast as at any size.  The figures, gloo's own
collectives and the rings by message size, are in benchmarks/RESULTS.md, section "One bucket's
collectives" (benchmarks/bench_collectives.py).

- All-gather: at step s a rank sends chunk (r - s) to its right neighbour and receives chunk
  (r - s - 1) from its left one, straight into the output: no temporary at all.  Step 0 sends from
  the shard itself, and copies it into the output's own chunk while the first pieces travel (a
  shard of another dtype, or not contiguous, is copied first and sent from there).
- Reduce-scatter: at step s a rank sends its partial sum of chunk (r - s - 1) and receives the left
  neighbour's partial sum of chunk (r - s - 2), which it adds into its own; after N-1 steps chunk r
  holds the whole sum.  The partial sums are written into the input's chunks (the input is scratch:
  zeroshard reduces a bucket in place and reads only its own chunk), and what is received arrives
  into two temporaries of one piece each, so that the transient is two pieces whatever the bucket's
  size (see [Note: gloo's whole-buffer copies] in distributed/collectives.py).

A chunk travels as pieces, and each piece goes round the ring on its own: a rank passes piece k of
step s on (step s+1's message) as soon as it has received it (and, in a reduce-scatter, added it),
without waiting for the rest of the step.  A collective launches step 0's messages and returns; the
rest runs in ``wait()``, which the progress thread calls at once ([Note: rings progress on their own
thread] in distributed/ring_progress.py).  Every message carries a tag of its own (the collective's,
drawn from a count kept per process group, plus the message's number), so that two collectives in
flight between the same two ranks cannot take each other's messages; the count advances identically on
every rank because every rank issues its collectives in the same order.  Both ends post a collective's
messages in the order of their numbers, so tags reused past ``_TAGS_PER_COLLECTIVE`` messages still
match in order.
"""

from __future__ import annotations

import collections
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
    """What both rings share: the neighbours, the pieces, tagged messages, and the sends still to be
    waited for."""

    def __init__(self, world: World, full: torch.Tensor, chunk: int, piece_bytes: int) -> None:
        self.world = world
        self.full = full
        self.chunk = chunk
        self.rank, self.size = world.rank, world.world_size
        self.right, self.left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        #: elements of one message; a chunk travels as pieces [lo, hi) of it (the last may be shorter)
        self.piece = max(1, min(piece_bytes // full.element_size(), chunk))
        self.ranges = [(lo, min(chunk, lo + self.piece)) for lo in range(0, chunk, self.piece)]
        self._base_tag = _next_base_tag(world)
        self._sends: collections.deque[Any] = collections.deque()
        #: receives posted and not yet waited for, oldest first: (work, step, piece number, temporary)
        self._receiving: collections.deque[tuple[Any, int, int, Optional[torch.Tensor]]] = collections.deque()

    def part(self, index: int, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """Elements [lo, hi) of chunk ``index`` (of the ring, mod N) of the full buffer."""
        start = (index % self.size) * self.chunk
        return self.full[start + lo: start + (self.chunk if hi is None else hi)]

    def _tag(self, step: int, piece: int) -> int:
        return self._base_tag + (step * len(self.ranges) + piece) % _TAGS_PER_COLLECTIVE

    def send(self, tensor: torch.Tensor, step: int, piece: int) -> None:
        """Piece ``piece`` of step ``step`` to the right neighbour, which receives it under the same
        numbers from its left."""
        tag = self._tag(step, piece)
        self._sends.append(dist.isend(tensor, group=self.world.group, group_dst=self.right, tag=tag))

    def receive(self, tensor: torch.Tensor, step: int, piece: int, temporary: Optional[torch.Tensor] = None) -> None:
        tag = self._tag(step, piece)
        work = dist.irecv(tensor, group=self.world.group, group_src=self.left, tag=tag)
        self._receiving.append((work, step, piece, temporary))

    def wait_sends(self, timeout: Optional[datetime.timedelta]) -> None:
        while self._sends:
            _wait(self._sends.popleft(), timeout)


class RingAllGather(_Ring):
    """Every rank's ``shard`` into ``full`` (N equal chunks), received in place (see the Note)."""

    def __init__(self, world: World, full: torch.Tensor, shard: torch.Tensor, piece_bytes: int) -> None:
        super().__init__(world, full, shard.numel(), piece_bytes)
        own = self.part(self.rank)
        source = shard  # step 0 sends this rank's chunk: from the shard, as the output's own chunk fills
        if shard.dtype != full.dtype or shard.device != full.device or not shard.is_contiguous():
            own.copy_(shard)  # what travels must be the output's kind of values
            source = own
        for piece, (lo, hi) in enumerate(self.ranges):
            self.send(source[lo:hi], 0, piece)
            self.receive(self.part(self.rank - 1, lo, hi), 0, piece)
        if own.data_ptr() != source.data_ptr():
            own.copy_(shard)  # while the first pieces travel

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        while self._receiving:
            work, step, piece, _ = self._receiving.popleft()
            _wait(work, timeout)
            if step + 1 < self.size - 1:  # pass the piece on: chunk (r - s - 1) is step s+1's to send
                lo, hi = self.ranges[piece]
                self.send(self.part(self.rank - step - 1, lo, hi), step + 1, piece)
                self.receive(self.part(self.rank - step - 2, lo, hi), step + 1, piece)
        self.wait_sends(timeout)
        return True


class RingReduceScatter(_Ring):
    """The sum over ranks of ``full``'s chunk r into ``output`` (``full`` is scratch; see the Note).

    Only the last step reads this rank's own chunk, so it may live outside ``full`` (``own_input``,
    possibly ``output`` itself: the sum then accumulates in place) and ``full``'s own chunk is never
    touched."""

    def __init__(self, world: World, full: torch.Tensor, output: torch.Tensor, piece_bytes: int,
                 own_input: Optional[torch.Tensor] = None) -> None:
        super().__init__(world, full, output.numel(), piece_bytes)
        self.output = output
        self.own_input = own_input
        self._free = [torch.empty(self.piece, dtype=full.dtype, device=full.device)
                      for _ in range(min(RECEIVES_IN_FLIGHT, len(self.ranges)))]
        #: (step, piece) still to be received, in the order they are sent
        self._to_receive = collections.deque((0, piece) for piece in range(len(self.ranges)))
        for piece in range(len(self.ranges)):
            self._send_partial(0, piece)
        self._receive_next()

    def _send_partial(self, step: int, piece: int) -> None:
        """Step s sends this rank's partial sum of chunk (r - s - 1)."""
        lo, hi = self.ranges[piece]
        self.send(self.part(self.rank - step - 1, lo, hi), step, piece)

    def _receive_next(self) -> None:
        while self._free and self._to_receive:
            step, piece = self._to_receive.popleft()
            lo, hi = self.ranges[piece]
            temporary = self._free.pop()
            self.receive(temporary[:hi - lo], step, piece, temporary)

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        last = self.size - 2
        while self._receiving:
            work, step, piece, temporary = self._receiving.popleft()
            assert temporary is not None
            _wait(work, timeout)
            lo, hi = self.ranges[piece]
            received = temporary[:hi - lo]
            index = self.rank - step - 2  # the chunk received at step s (r itself at the last)
            if step == last:
                own = self.part(index, lo, hi) if self.own_input is None else self.own_input[lo:hi]
                torch.add(own, received, out=self.output[lo:hi])
            else:  # the sum so far is step s+1's to send
                self.part(index, lo, hi).add_(received)
                self._send_partial(step + 1, piece)
                self._to_receive.append((step + 1, piece))
            self._free.append(temporary)
            self._receive_next()
        self.wait_sends(timeout)
        self._free = []
        return True


def _wait(work: Any, timeout: Optional[datetime.timedelta]) -> None:
    work.wait() if timeout is None else work.wait(timeout=timeout)
