"""Stage 3's parameter storage: each rank keeps only its chunk of every bucket; full buckets on demand.

[Note: releasing memory that autograd still points at]
Autograd saves parameters for backward (a Linear saves its weight).  Dropping our reference to a
gathered buffer would free nothing, and replacing ``param.data`` would leave autograd with a stale
tensor.  Instead every parameter is, once and for all, a view into its bucket's full buffer, and
releasing a bucket gives its memory back while the *storage* object stays, as the engine's buffer
memory does it ([Note: one buffer memory per engine] in host/buffer_memory.py): in host memory on
Linux its pages go (``madvise``, see [Note: releasing a gathered unit's pages] in host/page_release.py),
elsewhere the storage shrinks to zero bytes (``untyped_storage().resize_(0)``) and gathering re-grows
it.  Either way every view (the parameter, autograd's saved copies) keeps its shape, and gathering
all-gathers into the same storage, so those views see the right values again.
A released parameter still reports its full ``.shape``; reading its values outside forward raises a clear
error (see [Note: reading a sharded parameter outside forward] in sharding/stage3/placeholder.py).

[Note: a gathered unit borrows this rank's chunk]
A gathered unit's full buffer holds this rank's chunk in its own slot, and the store holds the same
values a second time: at DeepSpeed's default reuse distance every unit stays gathered from its forward
to its backward, so at the backward peak a rank would hold its whole shard twice (4Ψ/N bytes more in
fp32).  So a gathered unit *borrows* the chunk: where pages can move (host memory on Linux,
see [Note: released pages move to the next gather] in host/page_reserve.py), the gather moves the
store's whole pages under the chunk into the full buffer's slot (the buffer is placed so that the slot
lies at the chunk's offset within a page: :meth:`_allocate_full`) and sends from the slot, and
:meth:`release` moves them back; only the partial page at either end is copied.  Nothing is copied or
faulted, and the chunk's pages never wait in the page reserve.  Where they cannot move, a unit gathered
for training (:meth:`GatherScheduler.use`) lends its chunk by :meth:`lend_chunk`, which drops the
store's pages (the slot is the only copy), and :meth:`release` copies the slot back into pages from the
reserve.  Whatever reads or writes the chunks as a whole first takes every lent chunk back
(:meth:`take_back_chunks`): the optimizer step (it steps the store in place) and ``checkpoint_parts``
(saves, loads, pretrained weights); writes to one chunk (:meth:`commit_full`, the updater's pieces,
:meth:`shard_view`) take that chunk back.  Nothing is lent while something outside training reads the
chunks (an asynchronous save's copy, the engine's :meth:`set_copy_gate`), nor for chunks offloaded to
host memory or NVMe (``offload_param``), nor for persistent buckets, nor where the buffer memory does
not release pages (``BufferMemory.releases_pages``: device memory).  Moving the chunk's pages instead of
filling the slot from elsewhere leaves a forward with next to no page faults to take (measured in
benchmarks/RESULTS.md, section "What faulting released pages back in costs", paragraph "Stage 3's pages
moved, not faulted").
"""

from __future__ import annotations

from enum import Enum
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ...distributed.collectives import Collectives, PendingCollective
from ...host.buffer_memory import BufferMemory
from ...host.libc import PAGE
from ...host.page_release import whole_pages_of
from ...offload.policy import NoOffload, OffloadPolicy, Place, SwapFailure
from ..flat_params import bucket_values
from ..layout import BucketLayout, FlatLayout, ShardRanks
from ..master_weights import MasterWeights
from .compressed_gathers import CompressedGathers
from .shard_store import ShardStore
from .param_status import ZeroParamStatus
from .placeholder import ShardedParameterPlaceholder
from ..storage import HOMES, CopyGate, InitialValues, NoCopies, ParamHome

# What a released parameter's own .data becomes: zero elements, so that a stale reference to the
# Parameter object reads nothing rather than freed memory.
_EMPTY = torch.empty(0)


class GatherState(Enum):
    SHARDED = "sharded"  # only this rank's chunk exists
    GATHERING = "gathering"  # all-gather in flight
    GATHERED = "gathered"  # full values present


class ShardedParameters:
    """This rank's chunks of all buckets (``shard``) plus one full buffer per bucket, gathered on demand."""

    def __init__(self, layout: FlatLayout, params: Sequence[nn.Parameter], comm: Collectives,
                 model: nn.Module, buffer_memory: BufferMemory, persistent: frozenset[int] = frozenset(),
                 dtype: Optional[torch.dtype] = None, masters: Optional[MasterWeights] = None,
                 offload: OffloadPolicy = NoOffload(), initial: InitialValues = InitialValues(),
                 secondary: Optional[Collectives] = None, job_comm: Optional[Collectives] = None,
                 experts: Optional[Collectives] = None) -> None:
        first = params[0]
        self.layout = layout
        self.comm = comm
        self.job_comm = job_comm or comm
        self.rank = comm.world.rank
        #: expert parallelism: the group experts' buckets are sharded over (see [Note: experts sharded
        #: over the ranks that hold them] in experts/groups.py), and this rank's chunk of each bucket
        self.experts = experts
        self.ranks = ShardRanks(self.rank, experts.world.rank if experts is not None else 0)
        self.dtype, self.device = dtype or first.dtype, first.device
        self.persistent = persistent
        #: this rank's chunk of every bucket, on the device, in host memory or on NVMe (see shard_store.py)
        self.store = ShardStore(layout, self.dtype, self.device, persistent, offload, comm)
        self.params = list(params)
        self._registrations = self._find_registrations(model)
        self._placeholders: dict[int, ShardedParameterPlaceholder] = {}
        self.full: list[torch.Tensor] = []  # per bucket, 1D padded; storage shrunk to 0 when released
        self._views: dict[int, torch.Tensor] = {}  # parameter index -> its view into the full buffer
        self.state: list[GatherState] = []
        self._pending: dict[int, PendingCollective] = {}
        self._pins: dict[int, int] = {}  # bucket index -> GatheredParameters blocks holding it
        self.masters = masters
        #: hpZ: the group of the secondary partition, and this rank's secondary chunk of each
        #: non-persistent bucket, valid until the next step (see [Note: the secondary partition])
        self.secondary = secondary
        self._secondary: dict[int, torch.Tensor] = {}  # allocated once, reused after every step
        self._secondary_valid: set[int] = set()
        self._primary_pending: set[int] = set()
        #: how a released full buffer gives back its memory and a gather gets it again (chosen once by
        #: the engine: [Note: one buffer memory per engine] in host/buffer_memory.py)
        self.buffer_memory = buffer_memory
        #: buckets whose own chunk lives only in the full buffer's slot (see [Note: a gathered unit
        #: borrows this rank's chunk]); and what says the chunks are being read outside training
        self._lent: set[int] = set()
        self.copy_gate: CopyGate = NoCopies()
        #: gathers for compute in a packed form (FP8 layers' weights in FP8, or qwZ's int8 blocks), and the
        #: buckets such a gather left in place (see [Note: one seam for compressed gathers] in
        #: sharding/stage3/compressed_gathers.py)
        self.compressed: Optional[CompressedGathers] = None
        self._gathered_compressed: set[int] = set()
        self._dequantise: dict[int, Callable[[], None]] = {}  # packed gathers in flight: what finishes each
        buffer_memory.keep_for_run(self.store.device_shard)  # a lent chunk's memory comes back at its release
        # released memory waits for the next buffer filled (see [Note: released pages move to the next
        # gather] in host/page_reserve.py): at most what one forward's gathers need beyond the chunks
        # its units borrow
        buffer_memory.park_up_to(sum(b.padded_numel - b.shard_numel for b in layout.buckets
                                     if b.index not in persistent) * self.dtype.itemsize)

        with torch.no_grad():
            for bucket in layout.buckets:
                full = self._allocate_full(bucket)
                # built under zeroshard.Init: gathered one parameter at a time
                bucket_values(bucket, lambda i: initial.of(params[i]), full, None if bucket.frozen else masters)
                for slot in bucket.slots:
                    view = full[slot.offset: slot.offset + slot.numel].view(slot.shape)
                    params[slot.index].data = view
                    home = ParamHome(self, bucket.index, slot.name, self.device)
                    self._views[slot.index] = view
                    self._placeholders[slot.index] = ShardedParameterPlaceholder.create(params[slot.index], slot.name,
                                                                                        slot.index)
                    HOMES.add(params[slot.index], home)
                    HOMES.add(self._placeholders[slot.index], home)
                start, end = bucket.shard_range(self.ranks.of(bucket))
                self.store.write(bucket, 0, full[start:end])
                buffer_memory.keep_for_run(full)
                self.full.append(full)
                self.state.append(GatherState.GATHERED)
                if bucket.index not in persistent:
                    self.release(bucket.index)

    def comm_of(self, bucket: BucketLayout) -> Collectives:
        """The group ``bucket`` is gathered over: experts' buckets over the ranks holding the same experts."""
        if bucket.experts:
            assert self.experts is not None
            return self.experts
        return self.comm

    def _allocate_full(self, bucket: BucketLayout) -> torch.Tensor:
        """Bucket ``bucket``'s full buffer (zeros).  Where its chunk can be lent by moving pages, the
        buffer is a view placed so that this rank's slot lies at the same offset within a page as the
        chunk in the store (up to one page of slack before it): the chunk's whole pages can then move
        into the slot and back (see [Note: a gathered unit borrows this rank's chunk])."""
        own = self.store.view(bucket)
        if own is None or not self._may_lend(bucket.index):
            return torch.zeros(bucket.padded_numel, dtype=self.dtype, device=self.device)
        size = self.dtype.itemsize
        raw = torch.zeros(bucket.padded_numel + PAGE // size, dtype=self.dtype, device=self.device)
        start, _ = bucket.shard_range(self.ranks.of(bucket))
        shift = (own.data_ptr() - raw.data_ptr() - start * size) % PAGE
        return raw[shift // size: shift // size + bucket.padded_numel]

    def _find_registrations(self, model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
        """Where each parameter is registered (a tied weight is registered in several modules)."""
        index_of = {id(p): i for i, p in enumerate(self.params)}
        found: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for attr, p in module._parameters.items():
                if p is not None and id(p) in index_of:
                    found.setdefault(index_of[id(p)], []).append((module, attr))
        return found

    def _show(self, index: int, gathered: bool) -> None:
        """Point the parameters of bucket ``index`` (and their modules) at real data or placeholders."""
        for slot in self.layout.buckets[index].slots:
            param = self.params[slot.index]
            shown = param if gathered else self._placeholders[slot.index]
            param.data = self._views[slot.index] if gathered else _EMPTY
            self._show_param(slot.index, shown)

    def _show_param(self, index: int, shown: nn.Parameter) -> None:
        for module, attr in self._registrations.get(index, ()):
            module._parameters[attr] = shown

    # ------------------------------------------------------------------ views (the FlatParameters interface)
    @property
    def shard(self) -> torch.Tensor:
        """The chunks kept on the device (all of them without parameter offload)."""
        return self.store.device_shard

    @property
    def data(self) -> torch.Tensor:
        return self.shard

    def shard_view(self, bucket: BucketLayout, rank: int) -> torch.Tensor:
        """This rank's chunk of ``bucket`` (1D) where it is resident; only the own chunk is stored here."""
        assert rank == self.ranks.of(bucket), "stage 3 stores only this rank's chunk"
        self.take_back_chunk(bucket.index)
        view = self.store.view(bucket)
        if view is None:
            raise RuntimeError(f"bucket {bucket.index}'s shard lives on NVMe (offload_param): it has no "
                               f"in-memory view")
        return view

    def bucket_view(self, bucket: BucketLayout) -> torch.Tensor:
        return self.full[bucket.index]

    # ------------------------------------------------------------------ DeepSpeed's view of a parameter
    def partition_status(self, bucket: int) -> ZeroParamStatus:
        """Bucket ``bucket``'s state under DeepSpeed's names (the placeholders' ``ds_status``)."""
        return {GatherState.SHARDED: ZeroParamStatus.NOT_AVAILABLE, GatherState.GATHERING: ZeroParamStatus.INFLIGHT,
                GatherState.GATHERED: ZeroParamStatus.AVAILABLE}[self.state[bucket]]

    def own_part(self, bucket: int, index: int) -> torch.Tensor:
        """This rank's elements of parameter ``index`` of bucket ``bucket`` (a view of its chunk; the
        placeholders' ``ds_tensor``)."""
        layout = self.layout.buckets[bucket]
        slot = next(s for s in layout.slots if s.index == index)
        start, end = layout.shard_range(self.ranks.of(layout))
        lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
        chunk = self.shard_view(layout, self.ranks.of(layout))
        return chunk[lo - start: max(hi, lo) - start]

    # ------------------------------------------------------------------ gather / release
    def gather(self, index: int, label: str, async_op: bool = False, compute: bool = False) -> None:
        """Start (or finish) making bucket ``index``'s full values present on this rank; ``compute``: for a
        forward or backward, which may move a packed form (:meth:`compress_gathers`)."""
        if self._compressed_gather(index, label, compute):
            if not async_op:
                self.wait(index)
            return
        if self.state[index] is GatherState.SHARDED:
            bucket = self.layout.buckets[index]
            full = self.full[index]
            # a gather for anything but compute is exact: not from a secondary partition of quantised values
            valid = index in self._secondary_valid and (compute or not self._compresses(index))
            kept = self._secondary.get(index) if valid else None
            group = self.secondary if kept is not None else None
            lent = self._fill(index, lend=group is None)
            if group is not None and kept is not None:  # hpZ: gather inside the group
                with torch.no_grad():
                    self._pending[index] = group.all_gather(full, kept, f"{label}.hpz", async_op=True)
                self.state[index] = GatherState.GATHERING
                if self._compresses(index):  # the secondary partition holds the dequantised values
                    self._gathered_compressed.add(index)
                if not async_op:
                    self.wait(index)
                return
            own = lent if lent is not None else self.store.view(bucket)
            if own is None or own.device != full.device:  # offloaded: bring the chunk to its slot first
                start, end = bucket.shard_range(self.ranks.of(bucket))
                own = full[start:end]
                self.store.read_into(bucket, own)
            with torch.no_grad():
                self._pending[index] = self.comm_of(bucket).all_gather(full, own, label, async_op=True)
            self._primary_pending.add(index)
            self.state[index] = GatherState.GATHERING
        if not async_op:
            self.wait(index)

    def compress_gathers(self, gathers: CompressedGathers) -> None:
        """Gather the buckets ``gathers`` covers packed for compute from now on (set once, before the first
        step; see [Note: one seam for compressed gathers] in sharding/stage3/compressed_gathers.py)."""
        self.compressed = gathers

    def _compresses(self, index: int) -> bool:
        return self.compressed is not None and self.compressed.covers(index)

    def _exact_own(self, index: int) -> torch.Tensor:
        """This rank's exact chunk of gathered bucket ``index``: its slot, unless a packed gather rewrote
        the slot (then the store's, which is never lent then)."""
        bucket = self.layout.buckets[index]
        start, end = bucket.shard_range(self.ranks.of(bucket))
        slot = self.full[index][start:end]
        if index not in self._gathered_compressed or self.compressed is None or not self.compressed.rewrites_own_slot:
            return slot
        own = self.store.view(bucket)
        if own is None or own.device != slot.device:
            own = torch.empty_like(slot)
            self.store.read_into(bucket, own)
        return own

    def _compressed_gather(self, index: int, label: str, compute: bool) -> bool:
        """Gather bucket ``index`` packed if this gather may (True: done); a bucket a packed gather left in
        place is gathered again exactly for anything but compute.  With hpZ, a valid secondary partition
        serves a compute gather as it is (see [Note: gathering weights in int8 blocks] in
        sharding/stage3/quantised_gathers.py)."""
        if not compute and index in self._gathered_compressed:
            self.wait(index)
            bucket = self.layout.buckets[index]
            scratch = torch.empty_like(self.full[index])
            with torch.no_grad():
                self.comm_of(bucket).all_gather(scratch, self._exact_own(index), f"{label}.exact")
                self.full[index].copy_(scratch)
            self._gathered_compressed.discard(index)
            return True
        gathers = self.compressed
        if not compute or gathers is None or not gathers.covers(index) or self.state[index] is not GatherState.SHARDED:
            return False
        if index in self._secondary_valid:
            return False
        bucket, full = self.layout.buckets[index], self.full[index]
        self._fill(index, lend=False)
        start, end = bucket.shard_range(self.ranks.of(bucket))
        own, slot = self.store.view(bucket), full[start:end]
        with torch.no_grad():
            if own is None or own.device != full.device:
                self.store.read_into(bucket, slot)
                own = slot
            elif not gathers.rewrites_own_slot:  # the slot keeps the exact chunk; else packed from the store
                own = slot.copy_(own)
        self._pending[index], self._dequantise[index] = gathers.gather(
            self.comm_of(bucket), index, self.ranks.of(bucket), own, label, full)
        self._gathered_compressed.add(index)
        self._primary_pending.add(index)  # hpZ: the secondary partition is cut from what it gathers
        self.state[index] = GatherState.GATHERING
        return True

    def join_gather(self, index: int, label: str) -> None:
        """Take part in an all-gather of bucket ``index`` that other ranks need while this rank has it
        gathered already (see [Note: ranks agree on every gather] in sharding/stage3/gather_agreement.py):
        this rank's chunk is sent from its slot and what arrives goes to a scratch buffer, dropped at
        once."""
        self.wait(index)
        scratch = torch.empty_like(self.full[index])
        kept = self._secondary.get(index) if index in self._secondary_valid else None
        with torch.no_grad():
            if self.secondary is not None and kept is not None:  # the others gather inside the hpZ group
                self.secondary.all_gather(scratch, kept, f"{label}.hpz.joined")
                return
            bucket = self.layout.buckets[index]
            if self.compressed is not None and self.compressed.covers(index):  # the others gather it packed
                pending, _ = self.compressed.gather(self.comm_of(bucket), index, self.ranks.of(bucket),
                                                    self._exact_own(index), f"{label}.joined", None)
                pending.wait()
                return
            start, end = bucket.shard_range(self.ranks.of(bucket))
            self.comm_of(bucket).all_gather(scratch, self.full[index][start:end], f"{label}.joined")

    def _fill(self, index: int, lend: bool) -> Optional[torch.Tensor]:
        """Memory for bucket ``index``'s full buffer, about to be gathered (in host memory, pages from
        the reserve), except that where the chunk can be lent (``lend`` and :meth:`_may_lend`) the
        store's own pages move under the slot instead; then the slot is returned (the chunk, lent) for
        the gather to send from."""
        memory, full = self.buffer_memory, self.full[index]
        pages = self._slot_pages(index) if lend and self._may_lend(index) else None
        if pages is None:
            memory.refill(full)
            return None
        bucket = self.layout.buckets[index]
        start, end = bucket.shard_range(self.ranks.of(bucket))
        own, slot = self.store.view(bucket), full[start:end]
        assert own is not None
        first, last = pages
        memory.refill(full[:first])
        memory.refill(full[last:])
        if memory.hand_over(own, slot):  # the slot's whole pages: [first, last)
            self._lent.add(index)
            return slot
        memory.refill(full[first:last])
        return None

    def _slot_pages(self, index: int) -> Optional[tuple[int, int]]:
        """The elements [first, last) of bucket ``index``'s full buffer on the whole pages of this rank's
        slot: what a lent chunk's pages move into; None where the slot has no whole page."""
        bucket = self.layout.buckets[index]
        start, end = bucket.shard_range(self.ranks.of(bucket))
        slot = self.full[index][start:end]
        address, length = whole_pages_of(slot)
        if not length:
            return None
        first = start + (address - slot.data_ptr()) // slot.element_size()
        return first, first + length // slot.element_size()

    def wait(self, index: int) -> None:
        pending: Optional[PendingCollective] = self._pending.pop(index, None)
        if pending is not None:
            pending.wait()
            dequantise = self._dequantise.pop(index, None)
            if dequantise is not None:
                dequantise()
            self.state[index] = GatherState.GATHERED
            self._show(index, gathered=True)
            if index in self._primary_pending:
                self._primary_pending.discard(index)
                self._keep_secondary(index)

    def _keep_secondary(self, index: int) -> None:
        """[Note: the secondary partition]
        hpZ (``zero_hpz_partition_size``): the first gather of a bucket after a step comes from the
        primary partition, over every rank; this rank then keeps its chunk of the bucket as split over
        its hpZ group (padded_numel / S elements: the bucket is padded to a multiple of N, so of S too),
        and every later gather until the next step all-gathers those chunks inside the group.  DeepSpeed
        builds it the same way (``ds_secondary_tensor``) and uses it for backward; zeroshard uses it
        for any gather while it is valid, so the forward passes of later micro steps stay inside the
        group too.  A step, a load or a ``GatheredParameters`` change marks it stale
        (:meth:`drop_secondary`); its buffers stay allocated and are refilled, as DeepSpeed's are."""
        if self.secondary is None or index in self.persistent:
            return
        size = self.secondary.world.world_size
        chunk = self.layout.buckets[index].padded_numel // size
        start = self.secondary.world.rank * chunk
        values = self.full[index][start: start + chunk]
        kept = self._secondary.get(index)
        if kept is None:
            self._secondary[index] = values.clone()
        else:
            kept.copy_(values)
        self._secondary_valid.add(index)

    def drop_secondary(self, index: Optional[int] = None) -> None:
        """The owned chunks changed: the secondary partition (of bucket ``index``, or all) is stale."""
        if index is None:
            self._secondary_valid.clear()
        else:
            self._secondary_valid.discard(index)

    def secondary_bytes(self) -> int:
        """Bytes of hpZ's secondary partition (allocated by the first forward, kept from then on)."""
        return sum(t.numel() * t.element_size() for t in self._secondary.values())

    def pin(self, index: int, label: str, compute: bool = False) -> None:
        """Gather bucket ``index`` and keep it until :meth:`unpin` (forward hooks will not release it);
        ``compute``: for forwards and backwards only, as :meth:`gather`'s."""
        self.gather(index, label, compute=compute)
        self._pins[index] = self._pins.get(index, 0) + 1

    def pinned(self, index: int) -> bool:
        """Whether a ``GatheredParameters`` block holds bucket ``index`` gathered now."""
        return index in self._pins

    def unpin(self, index: int) -> None:
        self._pins[index] -= 1
        if not self._pins[index]:
            del self._pins[index]
            self.release(index)

    # ------------------------------------------------------------------ lending the own chunk
    def set_copy_gate(self, gate: CopyGate) -> None:
        """While ``gate.copying()``, something outside training reads the chunks (an asynchronous save's
        copy): no chunk is lent then (see [Note: a gathered unit borrows this rank's chunk])."""
        self.copy_gate = gate

    def _may_lend(self, index: int) -> bool:
        """Whether bucket ``index``'s chunk may be lent to its full buffer now (see the Note above)."""
        return (index not in self._lent and index not in self.persistent and self.buffer_memory.releases_pages
                and self.store.where[index] is Place.DEVICE  # offloaded: the chunk is elsewhere anyway
                and not self.copy_gate.copying())

    def lend_chunk(self, index: int) -> None:
        """Bucket ``index`` is gathered for training: its full buffer's slot becomes the only copy of
        this rank's chunk, and the store's pages under the chunk go (see the Note above).  A gather
        that moved the chunk's pages into the slot has lent it already."""
        if not self._may_lend(index) or self.state[index] is not GatherState.GATHERED:
            return
        if index in self._gathered_compressed and self.compressed is not None and self.compressed.rewrites_own_slot:
            return  # the slot holds dequantised values: the store keeps the exact chunk
        own = self.store.view(self.layout.buckets[index])
        assert own is not None
        # dropped, not parked: the forward's gathers have all been launched by now (prefetch), so
        # parked pages would wait through the forward's peak (see [Note: released pages move to the
        # next gather] in host/page_reserve.py)
        self.buffer_memory.drop(own)
        self._lent.add(index)

    def take_back_chunk(self, index: int) -> None:
        """Copy bucket ``index``'s lent chunk back from the full buffer's slot into the store."""
        if index not in self._lent:
            return
        bucket = self.layout.buckets[index]
        start, end = bucket.shard_range(self.ranks.of(bucket))
        self._refill_store(bucket)
        with torch.no_grad():
            self.store.write(bucket, 0, self.full[index][start:end])
        self._lent.discard(index)

    def _refill_store(self, bucket: BucketLayout) -> None:
        """A lent chunk's place in the store is about to be written: memory for it (pages from the reserve)."""
        own = self.store.view(bucket)
        if bucket.index in self._lent and own is not None:
            self.buffer_memory.refill(own)

    def take_back_chunks(self) -> None:
        """Every lent chunk back in the store: before anything reads or writes the chunks as a whole."""
        for index in sorted(self._lent):
            self.take_back_chunk(index)

    def lent_bytes(self) -> int:
        """Bytes of this rank's chunks lent to gathered full buffers now (0 between steps)."""
        return sum(self.layout.buckets[i].shard_numel for i in self._lent) * self.store.device_shard.element_size()

    def release(self, index: int) -> None:
        """Free bucket ``index``'s full buffer (persistent and pinned buckets are kept); a lent chunk
        goes back to the store first."""
        if index in self.persistent or index in self._pins or self.state[index] is GatherState.SHARDED:
            return
        self.wait(index)
        full, memory = self.full[index], self.buffer_memory
        bucket = self.layout.buckets[index]
        start, end = bucket.shard_range(self.ranks.of(bucket))
        own = self.store.view(bucket)
        pages = self._slot_pages(index) if index in self._lent else None  # lent: its pages can move
        if own is not None and pages and memory.hand_over(full[start:end], own):  # the chunk's pages go home
            self._lent.discard(index)
            memory.release(full[:pages[0]])  # the rest, the partial pages at the slot's ends included
            memory.release(full[pages[1]:])
        else:
            self.take_back_chunk(index)
            memory.release(full)
        self._show(index, gathered=False)
        self.state[index] = GatherState.SHARDED
        self._gathered_compressed.discard(index)

    def commit_full(self, index: int) -> None:
        """Copy this rank's part of a (modified) full bucket back into its shard."""
        bucket = self.layout.buckets[index]
        start, end = bucket.shard_range(self.ranks.of(bucket))
        self.drop_secondary(index)
        self._refill_store(bucket)
        with torch.no_grad():
            self.store.write(bucket, 0, self.full[index][start:end])
            self._lent.discard(index)  # the store holds the chunk again
            if self.masters is not None and not bucket.frozen:
                self.masters.take(bucket, self.full[index], only_changed=True)

    def write_own_chunk(self, index: int, chunk: torch.Tensor) -> None:
        """Replace this rank's chunk of frozen bucket ``index`` with ``chunk`` (trainable buckets have
        masters and optimizer state: they go through the updater)."""
        bucket = self.layout.buckets[index]
        assert bucket.frozen, "write_own_chunk is for frozen buckets"
        self.release(index)
        self.drop_secondary(index)
        with torch.no_grad():
            self.store.write(bucket, 0, chunk.to(self.dtype))

    def take_failure(self) -> SwapFailure:
        return self.store.take_failure()

    def detach_parameters(self) -> None:
        """Gather each bucket once more and give its parameters their own full values; the modules
        hold the real parameters again, no placeholder is left, and the registry forgets them."""
        with torch.no_grad():
            for bucket in self.layout.buckets:
                self.gather(bucket.index, f"detach{bucket.index}")
                self.take_back_chunk(bucket.index)
                for slot in bucket.slots:
                    self.params[slot.index].data = self._views[slot.index].clone()
                    self._show_param(slot.index, self.params[slot.index])
                self._pins.pop(bucket.index, None)
                self.buffer_memory.forget(self.full[bucket.index])  # freed for good: nothing of it may stay parked
                self.full[bucket.index].untyped_storage().resize_(0)
                self.state[bucket.index] = GatherState.SHARDED
        HOMES.forget([*self.params, *self._placeholders.values()])

    def close(self) -> None:
        """The store's files and threads; what the buffer memory parks is the engine's to drop."""
        self.store.close()

    def held_bytes(self, index: int) -> int:
        """Memory bucket ``index``'s full buffer holds now, measured: its resident pages where releasing
        gives back pages (whole pages: the partial page at either end is not counted), else its storage."""
        return self.buffer_memory.held_bytes(self.full[index])

    def gathered_bytes(self) -> int:
        """Bytes of the non-persistent full buffers gathered (or being gathered) now: 0 between steps.
        :meth:`held_bytes` measures what a buffer really holds."""
        return sum(self.full[b.index].numel() * self.full[b.index].element_size() for b in self.layout.buckets
                   if b.index not in self.persistent and self.state[b.index] is not GatherState.SHARDED)

    def persistent_bytes(self) -> int:
        size = self.store.device_shard.element_size()
        return sum(self.layout.buckets[i].numel * size for i in self.persistent)
