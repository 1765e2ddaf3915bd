"""Optimizers that need each matrix whole (Muon, Adafactor), stepped while their state stays sharded.

[Note: whole matrices, each on one rank]
The torch optimizer usually steps each rank's flat chunk of a bucket (see [Note: pieces] in
optim/updater.py), and a chunk cuts matrices anywhere.  Muon's Newton-Schulz iteration and
Adafactor's row and column moments need every element of a matrix at once, so the parameter groups
that such an optimizer steps are updated another way:

- **ownership**: each matrix of those groups is owned by one rank of the group its bucket is sharded
  over, chosen once, largest matrix first: the rank whose chunk holds most of it, so that what lies
  there never travels, unless that would lift the rank's elements above 1/N of the matrices'; then
  (and where no rank holds more of it than the least loaded one, as at stage 0) the rank that owns
  the fewest elements so far (ties to the lowest rank).  Every rank steps about 1/N of the matrices'
  elements and holds about 1/N of their state, which the memory formula counts;
- **the exchange in**: at the step, every rank sends the owner the part of the matrix's averaged
  gradient and of its values (the fp32 masters where there are any) that lies in its own chunk, in
  one ``all_to_all`` per bucket; at stage 0 every rank holds every bucket whole, so nothing moves;
- **the update**: the owner runs torch's own optimizer (``torch.optim.Muon``, ``torch.optim.Adafactor``)
  on the whole matrix, whose state (Muon's momentum, Adafactor's row and column moments) lives only
  there: the matrices' optimizer state is 1/N per rank at every stage, stage 0 included;
- **the exchange out**: the owner sends every other rank the updated values of its part of the chunk
  (stage 0: the whole matrix, a broadcast), in a second ``all_to_all``, and from there the stage's
  own path goes on: the masters are published into the parameters, stages 1-3 all-gather the
  chunks as after any step.

Bytes sent per optimizer step, with s the element size of the values (4 for fp32 masters), N ranks, M
the matrices' elements and A those of them lying outside their owner's chunk: stages 1-3 send 2 A s in
(a gradient and a value per element held away from its owner) and A s out, 3 A s in all, counted in
the ledger as ``all_to_all`` (labels ``matrices_in``, ``matrices_out``); each rank sends twice the
elements it holds of others' matrices and once the parts of its own held elsewhere.  A is 0 for a
matrix inside its owner's chunk and (N-1)/N of one cut evenly over the N chunks: M (N-1)/N where
every matrix is cut so (buckets smaller than a matrix), near 0 where buckets hold many whole matrices.
Stage 0 sends M (N-1) s out (every rank but the owner receives each matrix) and nothing in.  The values
come in because the owner holds only its chunk of the masters; with them, torch's optimizer runs its own
arithmetic on the whole matrix, and what differs from one process is only the order in which the
gradient's average was summed (which Muon's bf16 Newton-Schulz may then round otherwise).  The other
parameter groups (norms, biases, embeddings, the head) keep the chunked update.  Memory: the owner
builds the matrix's gradient and values for the step of one bucket at a time (two copies of that
bucket's owned matrices), freed after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..distributed.collectives import Collectives
from ..sharding.layout import BucketLayout, ParamSlot
from .matrix_state import ChunkedState

if TYPE_CHECKING:
    from ..sharding.strategy import ShardingStrategy


class WholeMatrixError(ValueError):
    """An optimizer that needs whole matrices was asked for where it cannot run."""


@dataclass(frozen=True)
class InnerSpec:
    """How one optimizer group's whole parameters are stepped: ``build`` makes torch's optimizer over
    them from the group's options; ``as_matrix``: each is stepped as a 2-D matrix (Muon), its first
    dimension by the rest (a convolution's filters), else in its own shape (Adafactor)."""

    build: Callable[[list[nn.Parameter], dict[str, Any]], torch.optim.Optimizer]
    as_matrix: bool = True
    #: the state as checkpoints save it, in chunks shaped as the parameter like every other state (see
    #: [Note: whole-matrix state in a checkpoint])
    state: ChunkedState = ChunkedState()

    def state_elements(self, shape: Sequence[int]) -> int:
        """The state elements torch's optimizer keeps for a parameter of ``shape`` (the formula the
        memory breakdown compares with): Muon one momentum element per element; Adafactor (not a
        matrix) a row and a column moment for two or more dimensions, else one per element."""
        numel = 1
        for d in shape:
            numel *= int(d)
        if self.as_matrix or len(shape) < 2:
            return numel
        rest = numel // (int(shape[-1]) * int(shape[-2]))
        return rest * (int(shape[-1]) + int(shape[-2]))


def stepped_shape(shape: Sequence[int], as_matrix: bool) -> tuple[int, ...]:
    """The shape a parameter is stepped in (see :class:`InnerSpec`)."""
    if not as_matrix or len(shape) <= 2:
        return tuple(int(d) for d in shape)
    rows, numel = int(shape[0]), 1
    for d in shape:
        numel *= int(d)
    return rows, numel // rows if rows else 0


def assign_owners(sizes: dict[int, int], world_size: int,
                  held: Optional[dict[int, list[int]]] = None) -> dict[int, int]:
    """Parameter index -> owner rank: largest first, each to the rank that holds most of it in its chunk
    (``held``: index -> elements in each rank's chunk) while that keeps its load within 1/N of the total,
    else to the least loaded rank (see [Note: whole matrices, each on one rank])."""
    load = [0] * world_size
    bound = sum(sizes.values()) / max(1, world_size)
    owners: dict[int, int] = {}
    for index, numel in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        parts = held.get(index) if held else None
        least = min(range(world_size), key=lambda r: (load[r], r))
        rank = least
        if parts is not None:
            near = max(range(world_size), key=lambda r: (parts[r], -load[r], -r))
            if parts[near] > parts[least] and load[near] + numel <= bound:
                rank = near
        owners[index] = rank
        load[rank] += numel
    return owners


@dataclass(frozen=True)
class BucketPlan:
    """Who holds which part of each matrix of one bucket, and who owns it."""

    bucket: BucketLayout
    comm: Collectives
    rank: int
    chunk_numel: int  # each rank's owned chunk (the whole bucket at stage 0)
    owners: dict[int, int]  # slot index (parameter index) -> owner rank

    @property
    def world_size(self) -> int:
        return self.comm.world.world_size

    @property
    def whole(self) -> bool:
        """Every rank holds the whole bucket (stage 0, or one rank)."""
        return self.chunk_numel == self.bucket.padded_numel

    def held(self, rank: int, slot: ParamSlot) -> tuple[int, int]:
        """[lo, hi) of ``slot``'s elements inside ``rank``'s chunk (empty when lo >= hi)."""
        start = self.bucket.chunk_start(self.chunk_numel, rank)
        lo = max(start, slot.offset) - slot.offset
        hi = min(start + self.chunk_numel, slot.offset + slot.numel) - slot.offset
        return lo, max(lo, hi)

    def parts(self, sender: int, receiver: int, owner_side: int) -> list[tuple[ParamSlot, int, int]]:
        """The matrix parts that travel from ``sender`` to ``receiver``: those of the matrices owned by
        ``owner_side`` (the receiver in, the sender out) lying in the non-owner's chunk."""
        if sender == receiver:
            return []
        other = sender if owner_side == receiver else receiver
        out = []
        for slot in self.bucket.slots:
            if self.owners[slot.index] != owner_side:
                continue
            lo, hi = self.held(other, slot)
            if hi > lo:
                out.append((slot, lo, hi))
        return out

    def moved_elements(self, inbound: bool) -> int:
        """Elements moved by every rank together in one direction (the same on every rank)."""
        key = "_moved_in" if inbound else "_moved_out"
        if key not in self.__dict__:
            n = self.world_size
            moved = 0 if inbound and self.whole else sum(
                hi - lo for s in range(n) for r in range(n) for _, lo, hi in self.parts(s, r, r if inbound else s))
            self.__dict__[key] = moved  # cached: the plan is fixed for the run
        return int(self.__dict__[key])


def _held(bucket: BucketLayout, chunk_numel: int, rank: int, slot: ParamSlot) -> int:
    """Elements of ``slot`` inside ``rank``'s chunk of ``chunk_numel``."""
    start = bucket.chunk_start(chunk_numel, rank)
    return max(0, min(start + chunk_numel, slot.offset + slot.numel) - max(start, slot.offset))


def _at(plan: BucketPlan, slot: ParamSlot, lo: int, hi: int) -> slice:
    """Elements ``[lo, hi)`` of ``slot`` in this rank's chunk."""
    start = plan.bucket.chunk_start(plan.chunk_numel, plan.rank) - slot.offset
    return slice(lo - start, hi - start)


def gather_to_owners(plan: BucketPlan, chunks: list[torch.Tensor], label: str) -> dict[int, list[torch.Tensor]]:
    """Owned matrix index -> each of ``chunks`` (this rank's chunks of the bucket, one dtype) as the
    whole matrix, 1-D, gathered from the ranks that hold its parts (views where this rank holds it all)."""
    mine = [s for s in plan.bucket.slots if plan.owners[s.index] == plan.rank]
    if plan.whole:
        return {s.index: [c[s.offset: s.offset + s.numel] for c in chunks] for s in mine}
    like = chunks[0]
    out = {s.index: [like.new_empty(s.numel) for _ in chunks] for s in mine}
    for s in mine:
        lo, hi = plan.held(plan.rank, s)
        for target, c in zip(out[s.index], chunks):
            target[lo:hi].copy_(c[_at(plan, s, lo, hi)])
    if plan.moved_elements(inbound=True) == 0:
        return out
    n, r, k = plan.world_size, plan.rank, len(chunks)
    sends = [plan.parts(r, d, d) for d in range(n)]
    send = torch.cat([c[_at(plan, s, lo, hi)] for parts in sends for s, lo, hi in parts for c in chunks]
                     or [like.new_empty(0)])
    recvs = [plan.parts(q, r, r) for q in range(n)]
    recv = like.new_empty(sum(k * (hi - lo) for parts in recvs for _, lo, hi in parts))
    plan.comm.all_to_all_uneven(recv, send, [k * sum(hi - lo for _, lo, hi in p) for p in recvs],
                                [k * sum(hi - lo for _, lo, hi in p) for p in sends], label,
                                k * plan.moved_elements(inbound=True) * like.element_size())
    at = 0
    for parts in recvs:
        for s, lo, hi in parts:
            for target in out[s.index]:
                target[lo:hi].copy_(recv[at: at + hi - lo])
                at += hi - lo
    return out


def scatter_from_owners(plan: BucketPlan, chunk: torch.Tensor, whole: dict[int, torch.Tensor], label: str) -> None:
    """Every rank's part of the owners' whole matrices (``whole``: owned index -> 1-D) into its ``chunk``
    (at stage 0 the step's matrices are views of the chunk already; a save's state is not)."""
    for index, v in whole.items():
        s = next(s for s in plan.bucket.slots if s.index == index)
        lo, hi = plan.held(plan.rank, s)
        target = chunk[_at(plan, s, lo, hi)]
        if hi > lo and target.data_ptr() != v[lo:hi].data_ptr():
            target.copy_(v[lo:hi])
    if plan.moved_elements(inbound=False) == 0:
        return
    n, r = plan.world_size, plan.rank
    sends = [plan.parts(r, d, r) for d in range(n)]
    send = torch.cat([whole[s.index][lo:hi] for parts in sends for s, lo, hi in parts] or [chunk.new_empty(0)])
    recvs = [plan.parts(q, r, q) for q in range(n)]
    recv = chunk.new_empty(sum(hi - lo for parts in recvs for _, lo, hi in parts))
    plan.comm.all_to_all_uneven(recv, send, [sum(hi - lo for _, lo, hi in p) for p in recvs],
                                [sum(hi - lo for _, lo, hi in p) for p in sends], label,
                                plan.moved_elements(inbound=False) * chunk.element_size())
    at = 0
    for parts in recvs:
        for s, lo, hi in parts:
            chunk[_at(plan, s, lo, hi)].copy_(recv[at: at + hi - lo])
            at += hi - lo


class WholeMatrixSteps:
    """The whole-matrix update of the buckets of some optimizer groups (see [Note: whole matrices,
    each on one rank]): which rank owns each matrix, the two exchanges, torch's optimizer on the owner."""

    def __init__(self, strategy: "ShardingStrategy", optimizer: torch.optim.Optimizer,
                 owned: dict[int, tuple[int, torch.Tensor]], groups: dict[int, InnerSpec]) -> None:
        """``owned``: bucket index -> (this rank's owned elements, a tensor of the values' dtype and device)."""
        self.optimizer = optimizer
        self.specs = groups
        #: the state in chunks, per bucket, as the last :meth:`spread_state` left it for a save
        self.spread: dict[int, dict[str, torch.Tensor]] = {}
        #: per bucket, the steps taken (a step-counting state's value, the same for all its matrices)
        self.steps: dict[int, int] = {}
        self.plans: dict[int, BucketPlan] = {}
        buckets = strategy.layout.buckets
        by_comm: dict[int, tuple[Collectives, dict[int, int], dict[int, list[int]]]] = {}
        for bucket in buckets:
            if bucket.group_index in groups:
                comm = strategy.comm_of(bucket)
                n, chunk = comm.world.world_size, owned[bucket.index][0]
                _, sizes, held = by_comm.setdefault(id(comm), (comm, {}, {}))
                for s in bucket.slots:
                    sizes[s.index] = s.numel
                    held[s.index] = [_held(bucket, chunk, r, s) for r in range(n)]
        owners: dict[int, int] = {}
        for comm, sizes, held in by_comm.values():
            owners.update(assign_owners(sizes, comm.world.world_size, held))
        #: the whole matrices this rank owns, by parameter index: a parameter object whose values are
        #: set for each step (the inner optimizer keys its state by it)
        self.matrices: dict[int, nn.Parameter] = {}
        self.inner: dict[int, torch.optim.Optimizer] = {}
        for bucket in buckets:
            if bucket.group_index not in groups:
                continue
            comm = strategy.comm_of(bucket)
            numel, like = owned[bucket.index]
            plan = BucketPlan(bucket, comm, strategy.ranks.of(bucket), numel,
                              {s.index: owners[s.index] for s in bucket.slots})
            self.plans[bucket.index] = plan
            for slot in bucket.slots:
                if owners[slot.index] == plan.rank:
                    self.matrices[slot.index] = nn.Parameter(like.new_empty(0, 0), requires_grad=False)
        for gi, spec in groups.items():
            mine = [self.matrices[s.index] for b in buckets if b.group_index == gi
                    for s in b.slots if s.index in self.matrices]
            options = {k: v for k, v in optimizer.param_groups[gi].items() if k != "params"}
            # a rank that owns none of the group's matrices still has the group (torch refuses an empty one)
            self.inner[gi] = spec.build(mine or [nn.Parameter(torch.empty(0, 0), requires_grad=False)], options)
        #: every rank's share of the matrices' state elements (the formula: 1/N of their total)
        self.formula_state_elements = sum(groups[b.group_index].state_elements(s.shape) / strategy.comm_of(b).world.world_size
                                          for b in buckets if b.group_index in groups for s in b.slots)
        #: the elements of the parameters stepped whole
        self.numel = sum(s.numel for b in buckets if b.group_index in groups for s in b.slots)
        self._shapes = {s.index: stepped_shape(s.shape, groups[b.group_index].as_matrix)
                        for b in buckets if b.group_index in groups for s in b.slots}

    def covers(self, bucket: BucketLayout) -> bool:
        return bucket.index in self.plans

    # ------------------------------------------------------------------ the step
    def step_bucket(self, bucket: BucketLayout, values: torch.Tensor, grad: torch.Tensor) -> None:
        """Update every matrix of ``bucket`` whole: ``values`` and ``grad`` are this rank's owned chunk
        (values updated in place)."""
        plan = self.plans[bucket.index]
        self.spread.pop(bucket.index, None)
        self.steps[bucket.index] = self.steps.get(bucket.index, 0) + 1
        whole = gather_to_owners(plan, [grad.to(values.dtype), values], "matrices_in")
        self._update(plan, whole)
        scatter_from_owners(plan, values, {i: parts[1] for i, parts in whole.items()}, "matrices_out")

    def _update(self, plan: BucketPlan, whole: dict[int, list[torch.Tensor]]) -> None:
        """torch's optimizer on this rank's whole matrices of the bucket, with the engine group's
        current hyperparameters (an LR schedule changes the engine's groups)."""
        if not whole:
            return
        gi = plan.bucket.group_index
        inner = self.inner[gi]
        group = self.optimizer.param_groups[gi]
        inner.param_groups[0].update({k: v for k, v in group.items() if k in inner.defaults})
        for index, (g, v) in whole.items():
            p = self.matrices[index]
            shape = self._shapes[index]
            p.data = v.view(shape)
            p.grad = g.view(shape)
        inner.step()
        for index in whole:
            p = self.matrices[index]
            p.grad = None
            p.data = p.data.new_empty(0, 0)

    # ------------------------------------------------------------------ state
    def spread_state(self, like: dict[int, torch.Tensor]) -> None:
        """[Note: whole-matrix state in a checkpoint]
        A checkpoint saves every optimizer state in the chunks of each bucket, which is what lets it
        load at another world size and stage.  Before a save, every rank calls this: the owners send
        each rank its chunk's part of the state, each tensor as one value per element of the parameter
        (Muon's momentum as it is, Adafactor's factored moments broadcast: [Note: factored moments in
        parameter-shaped chunks] in optim/matrix_state.py), the same exchange as the step's way out
        (label ``matrices_state``), and the save writes those chunks, with a step count as the bucket's
        scalar where the optimizer keeps one; a load sends the chunks to the owners
        (:meth:`load_state`), the step's way in.  ``like``: per bucket, a chunk of the values' dtype
        and device."""
        self.spread = {}
        for index, plan in self.plans.items():
            out = {}
            for key in self.state_keys(plan.bucket):
                chunk = torch.zeros_like(like[index])
                whole = {i: self._state_of(i, key, like[index]) for i in self._owned(plan)}
                scatter_from_owners(plan, chunk, whole, "matrices_state")
                out[key] = chunk
            self.spread[index] = out

    def scalars(self, bucket: BucketLayout) -> dict[str, torch.Tensor]:
        """The bucket's scalar state a save writes (the step count, where the optimizer keeps one)."""
        key = self.specs[bucket.group_index].state.step_key
        return {} if key is None else {key: torch.tensor(float(self.steps.get(bucket.index, 0)))}

    def load_state(self, bucket: BucketLayout, state: dict[str, torch.Tensor], scalars: dict[str, torch.Tensor],
                   like: torch.Tensor) -> None:
        """The chunks of the bucket's state (a load's) sent to the owners.  A matrix whose state the load
        lacks in part (a key, or the step count an optimizer keeps) starts afresh."""
        plan = self.plans[bucket.index]
        inner = self.inner[bucket.group_index]
        layout = self.specs[bucket.group_index].state
        keys = self.state_keys(bucket)
        wholes: dict[str, dict[int, torch.Tensor]] = {}
        for key in keys:
            chunk = state.get(key)
            chunk = torch.zeros_like(like) if chunk is None else chunk.to(like.dtype)
            wholes[key] = {i: w for i, (w,) in gather_to_owners(plan, [chunk], "matrices_state").items()}
        step = scalars.get(layout.step_key) if layout.step_key is not None else None
        self.steps[bucket.index] = int(step.item()) if step is not None else 0
        for index in self._owned(plan):
            p, shape = self.matrices[index], self._shapes[index]
            mine = layout.keys(shape)
            inner.state.pop(p, None)
            if any(k not in state for k in mine) or (layout.step_key is not None and step is None):
                continue
            loaded = {k: layout.restore(k, wholes[k][index], shape) for k in mine}
            if layout.step_key is not None and step is not None:
                loaded[layout.step_key] = step.detach().to("cpu", torch.get_default_dtype()).clone()
            inner.state[p] = loaded
        self.spread.pop(bucket.index, None)

    def _owned(self, plan: BucketPlan) -> list[int]:
        return [s.index for s in plan.bucket.slots if plan.owners[s.index] == plan.rank]

    def _state_of(self, index: int, key: str, like: torch.Tensor) -> torch.Tensor:
        """Owned parameter ``index``'s state ``key``, one value per element (zeros where it has none)."""
        p, shape = self.matrices[index], self._shapes[index]
        for gi, inner in self.inner.items():
            value = inner.state.get(p, {}).get(key)
            if isinstance(value, torch.Tensor):
                return self.specs[gi].state.spread(key, value, shape).to(like.dtype)
        numel = next(s.numel for b in self.plans.values() for s in b.bucket.slots if s.index == index)
        return like.new_zeros(numel)

    def state_bytes(self) -> int:
        """Bytes of the inner optimizers' state tensors on this rank (the owned matrices' only)."""
        return sum(t.numel() * t.element_size() for inner in self.inner.values() for state in inner.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)

    def scalar_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for inner in self.inner.values() for state in inner.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor) and t.dim() == 0)

    def state_keys(self, bucket: BucketLayout) -> tuple[str, ...]:
        """The state keys ``bucket``'s parameters have, as chunks (the same on every rank)."""
        layout = self.specs[bucket.group_index].state
        present = {k for s in bucket.slots for k in layout.keys(self._shapes[s.index])}
        return tuple(k for k in layout.names if k in present)

    def whole_state(self, bucket: BucketLayout, index: int, key: str, like: torch.Tensor) -> torch.Tensor:
        """Parameter ``index``'s state ``key``, 1-D, on every rank of the bucket's group: the owner's,
        summed with the others' zeros (one all-reduce; zeros before the first step)."""
        plan = self.plans[bucket.index]
        out = torch.zeros_like(like)
        if index in self.matrices:
            out.copy_(self._state_of(index, key, like))
        if plan.comm.world.is_distributed:
            plan.comm.all_reduce(out, f"matrix_state[{key}]")
        return out

    def set_whole_state(self, bucket: BucketLayout, index: int, key: str, value: torch.Tensor) -> None:
        """Set parameter ``index``'s state ``key`` where this rank owns it (``value`` the same everywhere)."""
        p = self.matrices.get(index)
        if p is not None:
            layout = self.specs[bucket.group_index].state
            restored = layout.restore(key, value.detach().reshape(-1), self._shapes[index])
            self.inner[bucket.group_index].state[p][key] = restored
