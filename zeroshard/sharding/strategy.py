"""What every ZeRO stage shares: gradient hooks, buckets launched in order, owned chunks, all-gather.

A stage is a :class:`ShardingStrategy` subclass that says only where ZeRO differs: where gradients
accumulate, which collective reduces a bucket, which part of the buffer this rank's optimizer owns,
and whether parameters are gathered after the step.  Stages 0-1 keep full-size gradients
(:mod:`.full_grads`), stages 2-3 reduce-scatter every bucket into this rank's chunks
(:mod:`.sharded_grads`, where each keeps them as its :mod:`.grad_chunks` policy says).  What the code
around a stage asks of it is one frozen :class:`StageTraits` per stage class (``strategy.traits``), not
a comparison of stage numbers.

[Note: launching buckets in order]
Collectives must be issued in the same order on every rank.  A bucket is launched only when all of its
parameters' gradients have arrived *and* every earlier bucket has been launched.  A parameter that got
no gradient on some rank (unused in that forward) simply holds its bucket back until the end of
backward, when the remaining buckets are launched in order with zeros in place of the missing
gradients: every rank issues the same sequence, so nothing hangs and no gradient is wrong.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Collection, Optional, Sequence

import torch
from torch import nn

from ..config import ZeroConfig
from ..distributed.collectives import Collectives, PendingCollective
from ..distributed.topology import ShardGroups
from ..distributed.world import World
from ..host.buffer_memory import BufferMemory
from ..offload.policy import OffloadPolicies, OffloadPolicy, Place
from ..precision import PrecisionPolicy
from .flat_params import FlatParameters
from .layout import BUCKETS_PER_MODEL, capped_bucket_numel, BucketLayout, FlatLayout, ParamSlot, ShardRanks, plan_buckets
from .master_weights import MasterWeights, owned_spans
from .quantised_reduction import QuantisedReduction, quantised_reduction
from .storage import InitialValues, ParameterStorage

if TYPE_CHECKING:
    from .stage3.gather_scheduler import GatherScheduler


def shard_ranks(groups: ShardGroups) -> ShardRanks:
    """This rank's place in the group of each kind of bucket (see :class:`ShardRanks`)."""
    experts = groups.expert_data
    return ShardRanks(groups.shard.world.rank, experts.world.rank if experts is not None else 0)


class BucketState(Enum):
    FILLING = "filling"  # waiting for gradients of this micro step
    IN_FLIGHT = "in_flight"  # its collective has been launched
    REDUCED = "reduced"  # its collective has finished and the result is stored


@dataclass
class BucketProgress:
    """Per-backward bookkeeping of one bucket."""

    arrived: set[int] = field(default_factory=set)
    #: parameters known to get no gradient in this backward (not reached by its graph)
    absent: set[int] = field(default_factory=set)
    state: BucketState = BucketState.FILLING
    pending: Optional[PendingCollective] = None

    def complete(self, bucket: BucketLayout) -> bool:
        """Every parameter of ``bucket`` has its gradient, or is known to get none."""
        return len(self.arrived) + len(self.absent - self.arrived) >= len(bucket.slots)


@dataclass
class ReplicaSum:
    """A bucket's sum across MiCS replicas in flight; ``wait()`` also writes a sum taken in the
    communication dtype back into the chunk (see [Note: the replicas' sums run behind backward])."""

    pending: PendingCollective
    sent: torch.Tensor
    owned: torch.Tensor

    def is_completed(self) -> bool:
        return self.pending.is_completed()

    def wait(self) -> None:
        self.pending.wait()
        if self.sent is not self.owned:
            self.owned.copy_(self.sent)


@dataclass(frozen=True)
class StageTraits:
    """What a ZeRO stage is, as the engine, the groups and the stage's own shared code ask it; each
    stage class declares its own once (``traits``)."""

    stage: int
    #: whether each rank holds a different part of the averaged gradients (the grad norm then needs a
    #: sum across ranks)
    grads_are_sharded: bool
    #: whether this rank's optimizer updates every bucket whole (stage 0) or only its chunk of each
    owns_whole_buckets: bool
    #: whether forward issues collectives (stage 3 gathers): the engine then checks that every rank
    #: is in the same forward first (see [Note: the consistency check] in distributed/consistency.py)
    forward_communicates: bool
    #: whether forward and backward gather parameters: ``build_shard_groups`` adds the groups their
    #: rounds need (see [Note: ranks agree on every gather] in sharding/stage3/gather_agreement.py)
    gathers_in_passes: bool
    #: whether each rank holds only its chunk of the parameters (stage 3): a model built under
    #: ``zeroshard.Init`` is adopted as it is, the model goes to the device bucket by bucket, and full
    #: weights are gathered for ``save_16bit_model`` only when the config asks
    shards_parameters: bool = False
    #: whether the stage has nothing to do without an optimizer (stages 1-2 shard only what training
    #: needs: see [Note: an engine without an optimizer] in optim/no_optimizer.py)
    needs_optimizer: bool = False
    #: the fewest buckets a model is cut into (see [Note: buckets smaller than the model] in sharding/layout.py)
    buckets_per_model: int = BUCKETS_PER_MODEL
    #: launched gradient buckets allowed in flight before the oldest is waited for (see ``_retire``)
    max_buckets_in_flight: int = 2


class ShardingStrategy(ABC):
    """Gradient reduction, optimizer ownership and parameter refresh for one ZeRO stage."""

    traits: ClassVar[StageTraits]

    def __init__(self, storage: ParameterStorage, params: Sequence[torch.nn.Parameter], groups: ShardGroups,
                 zero: ZeroConfig, precision: PrecisionPolicy = PrecisionPolicy()) -> None:
        #: where the trainable parameters' values live (stages 0-2: one flat buffer; stage 3: this
        #: rank's chunks)
        self.storage = storage
        self.precision = precision
        #: fp32 copies of the owned parameters when the model computes in 16 bits (else None)
        self.masters: Optional[MasterWeights] = storage.masters
        #: called with each bucket once its gradients are averaged at an accumulation boundary
        self._reduced_listeners: list[Callable[[BucketLayout], None]] = []
        #: the trainable buckets (stage 3's storage also holds frozen ones after them)
        self.layout = storage.layout.trainable()
        self.params = list(params)
        #: the shard group's collectives and world: the whole job, or a MiCS group
        self.comm: Collectives = groups.shard
        self.world: World = groups.shard.world
        #: expert parallelism: the group experts' buckets are sharded over (see ``comm_of``)
        self.expert_comm: Optional[Collectives] = groups.expert_data
        #: this rank's chunk of each bucket (``ranks.of(bucket)``)
        self.ranks: ShardRanks = shard_ranks(groups)
        #: MiCS: the ranks holding this rank's shard in the other groups (see [Note: hybrid sharding
        #: groups] in distributed/topology.py)
        self.replicas: Optional[Collectives] = groups.replicas
        #: every rank of the job: what gradients are averaged over
        self.data_parallel_size = groups.data_parallel_size
        self.zero = zero
        #: ZeRO++'s qgZ (``zero_quantized_gradients``): the buckets' reductions as two quantised all-to-alls
        self.quantised_reduction = quantised_reduction(groups, zero)
        #: qgZ for experts' buckets, over the ranks holding the same experts (None: off, or a group of one)
        self.experts_quantised_reduction = quantised_reduction(groups, zero, experts=True)
        self.sync_gradients = True  # set by the engine before each backward
        self._slot_of = self.layout.slot_of()
        self._progress = [BucketProgress() for _ in self.layout.buckets]
        self._next_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        #: buckets reduced whose replicas and listeners have not been told yet (see ``_retire``)
        self._reduced_later: list[BucketLayout] = []
        #: MiCS: buckets whose sum across replicas is in flight, in order, before their listeners hear
        self._replica_sums: list[tuple[BucketLayout, Optional[ReplicaSum]]] = []
        #: parameter all-gathers in flight after a step, by bucket index, in launch order
        self._gathers: list[tuple[int, PendingCollective]] = []
        self._gather_numel = 0
        #: whether the gathers may outlive step() (see [Note: the parameter gather runs into the next forward])
        self._deferred = False
        #: ``ignore_unused_parameters: false``: the parameters the last backward gave no gradient
        self.unused: tuple[str, ...] = ()

    @property
    def stage(self) -> int:
        """The ZeRO stage number."""
        return self.traits.stage

    def gather_scheduler(self) -> Optional["GatherScheduler"]:
        """What gathers parameters in forward and backward (``traits.gathers_in_passes``); None where
        nothing does."""
        return None

    def comm_of(self, bucket: BucketLayout) -> Collectives:
        """The group ``bucket`` is sharded over: the shard group, or for experts' buckets the ranks that
        hold the same experts (see [Note: experts sharded over the ranks that hold them] in experts/groups.py)."""
        if bucket.experts:
            assert self.expert_comm is not None
            return self.expert_comm
        return self.comm

    # ------------------------------------------------------------------ backward
    @abstractmethod
    def communicates_now(self) -> bool:
        """Whether this backward reduces its gradients: at every micro step (stages 2-3) or only at
        the accumulation boundary (``sync_gradients``, stages 0-1)."""

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: move the gradient into zeroshard's storage, maybe launch."""
        grad = param.grad
        param.grad = None
        index = self._index_of[id(param)]
        bucket, slot = self._slot_of[index]
        progress = self._progress[bucket.index]
        if progress.state is not BucketState.FILLING:
            raise RuntimeError(
                f"parameter {slot.name!r} received a second gradient after its bucket was reduced in this "
                f"backward: it is used both inside and outside a region checkpointed with "
                f"use_reentrant=True, whose nested backward accumulates it separately; checkpoint with "
                f"use_reentrant=False (zeroshard's default)"
            )
        assert grad is not None
        with torch.no_grad():
            self.store_grad(bucket, slot, grad.reshape(-1), first=index not in progress.arrived)
        progress.arrived.add(index)
        self.grad_arrived(bucket, progress)
        if self.communicates_now():
            self._launch_in_order(only_complete=True)

    def _launch_in_order(self, only_complete: bool) -> None:
        buckets = self.layout.buckets
        while self._next_launch < len(buckets):
            bucket = buckets[self._next_launch]
            progress = self._progress[bucket.index]
            if only_complete and not progress.complete(bucket):
                return
            with torch.no_grad():
                progress.pending = self.launch(bucket, async_op=self.zero.overlap_comm)
            progress.state = BucketState.IN_FLIGHT
            self._next_launch += 1
            self._retire(keep_in_flight=self.traits.max_buckets_in_flight)

    def _retire(self, keep_in_flight: int) -> None:
        """Wait for the oldest launched buckets until at most ``keep_in_flight`` remain in flight.

        This bounds the memory of full-size buckets alive at once (stage 2) to a few buckets,
        whatever the model size, while still overlapping each collective with the next bucket's
        backward.  Where waiting now could deadlock (:meth:`may_block`), only the buckets already
        reduced are retired, and replicas are summed once the backward is over.
        """
        launched = self.layout.buckets[:self._next_launch]
        in_flight = [b for b in launched if self._progress[b.index].state is BucketState.IN_FLIGHT]
        block = self.may_block()
        with torch.no_grad():
            for bucket in in_flight[:max(0, len(in_flight) - keep_in_flight)]:
                progress = self._progress[bucket.index]
                assert progress.pending is not None
                if not block and not progress.pending.is_completed():
                    return
                progress.pending.wait()
                self.complete(bucket)
                progress.state = BucketState.REDUCED
                if self.sync_gradients:
                    self._reduced_later.append(bucket)
                    if block:
                        self._after_reduction()

    def _after_reduction(self) -> None:
        """Launch the sums of the reduced buckets' chunks with their replicas (MiCS) and tell the
        listeners, in order, of the buckets whose sum is done (see [Note: the replicas' sums run behind
        backward])."""
        reduced, self._reduced_later = self._reduced_later, []
        for bucket in reduced:
            self._replica_sums.append((bucket, self.reduce_across_replicas(bucket)))
        self._tell_listeners(wait=False)

    def _tell_listeners(self, wait: bool) -> None:
        """Tell the listeners of each bucket whose sum across replicas is done, in order; ``wait``: of
        every bucket, waiting for the sums."""
        while self._replica_sums:
            bucket, summed = self._replica_sums[0]
            if summed is not None:
                if not wait and not summed.is_completed():
                    return
                summed.wait()
            self._replica_sums.pop(0)
            for listener in self._reduced_listeners:
                listener(bucket)

    def may_block(self) -> bool:
        """Whether backward may wait here for a bucket's reduction (stage 3 with gather rounds may not:
        the rank it waits for may be waiting for it in a round)."""
        return True

    def expect_gradients(self, loss: torch.Tensor) -> None:
        """Before ``loss.backward()``: learn which parameters this backward will reach (stage 3)."""

    def finish_backward(self) -> None:
        """End of a backward: launch what is left (in order), wait for everything, store results."""
        if self.communicates_now():
            self._launch_in_order(only_complete=False)
            self._retire(keep_in_flight=0)
            self._after_reduction()
            self._tell_listeners(wait=True)
        if not self.zero.ignore_unused_parameters:
            self.unused = self._unused_names()
        self._progress = [BucketProgress() for _ in self.layout.buckets]
        self._next_launch = 0

    def _unused_names(self) -> tuple[str, ...]:
        """The trainable parameters that got no gradient in this backward."""
        return tuple(slot.name for bucket in self.layout.buckets for slot in bucket.slots
                     if slot.index not in self._progress[bucket.index].arrived)

    def reduce_across_replicas(self, bucket: BucketLayout) -> Optional["ReplicaSum"]:
        """MiCS: launch the sum of this rank's averaged shard of ``bucket`` with the ranks that hold the
        same shard in the other shard groups, once per optimizer step (in the communication dtype).

        [Note: the replicas' sums run behind backward]
        Each bucket's sum across replicas is launched as soon as its chunk is reduced and waited for
        only when its listeners need it: as backward goes on when it has finished, at the latest at
        the end of backward.  Waiting at once would hold backward up at every bucket: on a GPU the
        compute stream would wait for each sum before computing the next gradients, on gloo the host.
        The listeners (the host optimizer's copy of the gradient) hear of the buckets in order."""
        if self.replicas is None:
            return None
        owned = self.owned_grad(bucket)
        sent = owned if owned.dtype == self.precision.comm else owned.to(self.precision.comm)
        return ReplicaSum(self.replicas.all_reduce(sent, f"grad_replicas{bucket.index}", async_op=True), sent, owned)

    def add_reduced_listener(self, listener: Callable[[BucketLayout], None]) -> None:
        """Call ``listener(bucket)`` once each bucket's gradients are averaged at a boundary (the host
        optimizer copies them out while backward goes on)."""
        self._reduced_listeners.append(listener)

    # ------------------------------------------------------------------ construction and hooks for subclasses
    @classmethod
    def build(cls, model: nn.Module, params: Sequence[nn.Parameter], names: Sequence[str],
              group_of: Sequence[int], groups: ShardGroups, zero: ZeroConfig,
              precision: PrecisionPolicy = PrecisionPolicy(), offload: OffloadPolicies = OffloadPolicies(),
              initial: InitialValues = InitialValues(), frozen: Sequence[tuple[str, nn.Parameter]] = (),
              *, buffer_memory: BufferMemory, experts: Collection[int] = (),
              interleaved_groups: bool = False) -> "ShardingStrategy":
        """Lay out the trainable parameters and take them over (stages 0-2: one flat buffer), sharded
        over ``groups.shard``; ``frozen`` (name, parameter) pairs stay whole at stages 0-2, as in DDP;
        ``buffer_memory``: the engine's (see [Note: one buffer memory per engine] in
        host/buffer_memory.py); ``experts``: the indices of experts' parameters (expert
        parallelism), in buckets of their own over ``groups.expert_data``; ``interleaved_groups``: the
        parameter groups alternate in model order (see [Note: buckets of groups that alternate] in
        sharding/layout.py)."""
        comm = groups.shard
        bucket_numel = capped_bucket_numel(zero.reduce_bucket_size, sum(p.numel() for p in params),
                                           cls.traits.buckets_per_model)
        layout = plan_buckets(params, names, group_of, bucket_numel, comm.world.world_size, experts,
                              groups.expert_data.world.world_size if groups.expert_data is not None else 0,
                              interleaved_groups)
        masters = cls.make_masters(layout, shard_ranks(groups), precision, offload, params[0].device, comm)
        storage = FlatParameters(layout, params, comm, buffer_memory, precision.compute, masters, groups.job)
        strategy = cls(storage, params, groups, zero, precision)
        strategy.hook_model(model)
        return strategy

    def hook_model(self, model: nn.Module) -> None:
        """Module hooks this stage needs besides its gradient hooks (none unless a stage says so)."""

    @classmethod
    def make_masters(cls, layout: FlatLayout, ranks: ShardRanks, precision: PrecisionPolicy, offload: OffloadPolicies,
                     device: torch.device, comm: Collectives) -> Optional[MasterWeights]:
        """fp32 master weights over what this stage's optimizer owns: with mixed precision, or whenever
        the optimizer or the parameter shards are offloaded (also for fp32 training: with the shards
        alone in host memory, the optimizer steps device copies and publishes into the shards); where the
        policy places them (the device, host memory, or straight into swap files); otherwise None."""
        policy: OffloadPolicy = offload.optimizer
        if not (precision.mixed or policy.needs_masters or offload.params.place is not Place.DEVICE):
            return None
        whole_buckets = cls.traits.owns_whole_buckets
        spans = owned_spans(layout, ranks, whole_buckets)
        spill = policy.open_master_swap(spans, offload.sub_group_size, comm)
        in_host = policy.place is not Place.DEVICE
        return MasterWeights(layout, ranks, whole_buckets, policy.masters_device(device),
                             policy.pin_memory and in_host and comm.world.device_policy.pin_host_memory, spill)

    def before_forward(self) -> None:
        """Called at the start of every engine forward."""

    def grad_arrived(self, bucket: BucketLayout, progress: BucketProgress) -> None:
        """Called after each parameter's gradient has been stored."""

    def param_bytes(self) -> tuple[int, int]:
        """(bytes of real parameter elements held, bytes of padding)."""
        size = self.storage.dtype.itemsize
        return self.layout.numel * size, (self.layout.padded_numel - self.layout.numel) * size

    def frozen_bytes(self) -> tuple[int, int]:
        """(bytes, padding) of the frozen parameters the storage holds: none below stage 3."""
        return 0, 0

    def param_placement(self) -> tuple[int, int]:
        """(bytes of real parameter elements in host memory, on NVMe) under parameter offload."""
        return 0, 0

    def extra_memory(self) -> dict[str, Any]:
        """Stage-specific entries of the memory breakdown."""
        reductions = [(b, self.quantised_reduction_of(b)) for b in self.layout.buckets]
        # transient: each bucket in flight holds its two hops' packed buffers and fp32 sums while it reduces
        largest = max((q.buffer_bytes(b.shard_numel) for b, q in reductions if q is not None), default=None)
        return {} if largest is None else {"qgz_buffers": self.traits.max_buckets_in_flight * largest}

    def quantised_reduction_of(self, bucket: BucketLayout) -> Optional[QuantisedReduction]:
        """ZeRO++'s qgZ for ``bucket``: over the shard group's qgZ groups, or the experts' (None: reduced
        without it)."""
        return self.experts_quantised_reduction if bucket.experts else self.quantised_reduction

    # ------------------------------------------------------------------ stage-specific
    @abstractmethod
    def store_grad(self, bucket: BucketLayout, slot: ParamSlot, grad: torch.Tensor, first: bool) -> None:
        """Keep one parameter's flattened gradient in its ``slot`` of ``bucket``; ``first``: the first
        gradient of that parameter in this backward (a later one is added to it)."""

    @abstractmethod
    def launch(self, bucket: BucketLayout, async_op: bool) -> PendingCollective:
        """Start reducing ``bucket`` (already averaged over ranks on return of ``complete``)."""

    def complete(self, bucket: BucketLayout) -> None:
        """Called once the bucket's collective has finished."""

    def reduce_to_owner(self, bucket: BucketLayout, full: torch.Tensor, async_op: bool,
                        own: Optional[torch.Tensor] = None, into: Optional[torch.Tensor] = None) -> PendingCollective:
        """Sum ``full`` (the whole bucket, already divided: ``PrecisionPolicy.before_reduction``) over
        the ranks so that this rank's chunk of it holds its averaged chunk (stages 1-3); the rest of
        ``full`` is then garbage.

        The reduce-scatter is in place: its output is this rank's own chunk of ``full``, which nothing
        else needs once the collective has read it (NCCL documents this form; gloo reads its inputs
        first), so no shard-size buffer is held beside the full-size one.  Without ``reduce_scatter``
        the bucket is all-reduced in place and the same chunk is read from it.

        ``own``: this rank's chunk kept outside ``full``, holding its own share of the input; the sum
        accumulates there instead (stage 2: [Note: stage 2's own chunk is reduced in place] in
        sharding/grad_chunks.py).  ``into``: where this rank's summed chunk is written instead, a plain
        reduce-scatter only (stage 3: [Note: stage 3's first reduction lands in its chunk] in
        sharding/grad_chunks.py).
        """
        label = f"grad_bucket{bucket.index}"
        comm = self.comm_of(bucket)
        quantised = self.quantised_reduction_of(bucket)
        if quantised is not None:  # ZeRO++'s qgZ
            start, end = bucket.shard_range(self.ranks.of(bucket))
            return quantised.reduce(full, full[start:end] if own is None else own, own, label)
        if not self.zero.reduce_scatter:
            assert own is None, "a chunk kept outside the bucket needs a reduce-scatter"
            return comm.all_reduce(full, label, async_op=async_op)
        start, end = bucket.shard_range(self.ranks.of(bucket))
        output = own if own is not None else full[start:end] if into is None else into
        return comm.reduce_scatter(output, full, label, async_op=async_op, own_input=own)

    @abstractmethod
    def owned_grad(self, bucket: BucketLayout) -> torch.Tensor:
        """The averaged gradient of the part of ``bucket`` this rank's optimizer updates."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Forget accumulated gradients (after the optimizer step), giving their memory back.

        [Note: gradients live from backward to the step]
        Every stage holds its averaged gradients from backward to the optimizer step, each in the way
        its memory peak asks.  At stage 3 each bucket's chunk is a buffer whose pages are taken when
        the bucket's first reduction of a step completes and given back as soon as the optimizer has
        stepped that bucket (:meth:`release_grad`), or by ``zero_grad()``: the forward holds no
        gradient memory ([Note: where gradient chunks live] in sharding/grad_chunks.py).  Stage 2
        keeps its chunks for the run and sums into them in place ([Note: stage 2's own chunk is
        reduced in place] in sharding/grad_chunks.py): its peak is in backward, where they are live
        anyway, and :meth:`release_grad` only marks a chunk as free to be overwritten by the next
        backward.  Stages 0-1 keep one full-size buffer, forgotten after the step ([Note: a full
        gradient buffer zeroed where it was not written] in sharding/full_grads.py): given back at
        each step, it would be 4Ψ of fresh memory to fault in at every step (their buckets are above
        glibc's largest mmap threshold, so every free goes back to the kernel), step time paid for
        little at the peak.  ``grad_bytes()`` reports the ZeRO formula's gradient term at every stage:
        what is held from the end of backward to the step.
        """

    @abstractmethod
    def release_grad(self, bucket: BucketLayout) -> None:
        """The optimizer has stepped ``bucket``: drop its gradients (see the Note above)."""

    @abstractmethod
    def held_grad_bytes(self) -> int:
        """Bytes the gradient buffers hold right now (stage 3: none between a step and the next backward)."""

    def owned_param(self, bucket: BucketLayout) -> torch.Tensor:
        """The part of the parameter storage this rank's optimizer updates, for ``bucket``."""
        return self.storage.shard_view(bucket, self.ranks.of(bucket))

    def publish_piece(self, bucket: BucketLayout, start: int, values: torch.Tensor) -> None:
        """Write updated master values (fp32, from element ``start`` of the owned chunk) into the owned
        parameters, rounded to their dtype (and moved to their device)."""
        with torch.no_grad():
            self.owned_param(bucket)[start: start + values.numel()].copy_(values)

    def owned_real(self, bucket: BucketLayout) -> int:
        """Real (non-padding) elements of ``bucket`` that this rank's optimizer updates."""
        return bucket.real_numel_in_shard(self.ranks.of(bucket))

    def owned_real_numel(self) -> int:
        return sum(self.owned_real(b) for b in self.layout.buckets)

    # ------------------------------------------------------------------ parameter refresh after the step
    def refresh_bucket(self, bucket: BucketLayout) -> None:
        """Start making ``bucket``'s full parameters current on every rank; its chunk was just updated.

        The gather is in place: this rank's chunk *is* its slice of the output (NCCL documents this
        form; gloo copies the input into its own slot first, a no-op), so no copy of the shard is made.
        At most ``allgather_bucket_size`` elements are in flight: older gathers are waited for first.
        """
        if self._gathers and self._gather_numel + bucket.padded_numel > self.zero.allgather_bucket_size:
            self.finish_refresh()
        own = self.storage.shard_view(bucket, self.ranks.of(bucket))
        with torch.no_grad():
            self._gathers.append((bucket.index, self.comm_of(bucket).all_gather(
                self.storage.bucket_view(bucket), own, f"param_bucket{bucket.index}", async_op=True)))
        self._gather_numel += bucket.padded_numel

    @property
    def pending_gathers(self) -> int:
        """Parameter gathers launched by the last step and not yet waited for."""
        return len(self._gathers)

    def end_refresh(self) -> None:
        """The end of ``step()``: wait for the parameter gathers, unless they run on into the next forward."""
        if not self._deferred:
            self.finish_refresh()

    def finish_refresh(self) -> None:
        """Wait until every parameter gather started by :meth:`refresh_bucket` has finished."""
        self.wait_for_buckets(None)

    def wait_for_buckets(self, indices: Optional[Collection[int]]) -> None:
        """Wait until the gathers of these buckets (None: all) have finished, and those launched before
        them: a group runs its collectives in the order they were launched."""
        if not self._gathers:
            return
        upto = len(self._gathers) if indices is None else 1 + max(
            (i for i, (index, _) in enumerate(self._gathers) if index in indices), default=-1)
        for index, pending in self._gathers[:upto]:
            pending.wait()
            self._gather_numel -= self.layout.buckets[index].padded_numel
        del self._gathers[:upto]

    def defer_refresh_to_forward(self, model: nn.Module) -> None:
        """[Note: the parameter gather runs into the next forward]
        At stages 1-2 every rank holds the whole model but updates only its chunk of each bucket, and
        the updated chunks are all-gathered after the step.  Waiting for that gather at the end of
        ``step()`` leaves it exposed (nothing else is running then); DDP has no such phase.  With
        ``overlap_param_gather``, ``step()`` launches the gathers in the order the forward uses the
        buckets and returns, and each module with parameters waits, in a forward pre-hook, only
        for the gathers of its own buckets, so the gather of later layers runs while earlier ones
        compute, as stage 3 prefetches.  Everything else that reads the parameters waits for all of
        them first: ``module.state_dict()`` (a pre-hook), the engine's backward, checkpoints,
        ``full_state_dict()``, ``GatheredParameters`` and ``close()``.  What cannot wait is a direct read
        of a parameter tensor between ``step()`` and the next forward (an EMA; a script comparing weights
        after its loop, as this project's own tests do): it may see values from before the step.  That
        is why it is off by default, and ``step()`` waits, as DeepSpeed's does.
        """
        bucket_of = {id(p): self._slot_of[i][0].index for i, p in enumerate(self.params)}
        for module in model.modules():
            needed = frozenset(bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of)
            if needed:
                # eager under torch.compile: [Note: stage-3 hooks run outside compiled regions] in
                # sharding/stage3/gather_scheduler.py holds for this wait as well
                self._hooks.append(module.register_forward_pre_hook(torch.compiler.disable(
                    lambda _module, _args, needed=needed: self.wait_for_buckets(needed))))
        self._hooks.append(model.register_state_dict_pre_hook(lambda *_: self.finish_refresh()))
        assert isinstance(self.storage, FlatParameters)  # stages 1-2
        self.storage.before_read = self.wait_for_buckets
        self._deferred = True

    def comm_buffer_bytes(self) -> int:
        """Bytes of persistent communication buffers (the pools)."""
        return 0

    def grad_bytes(self) -> tuple[int, int]:
        """(bytes of real gradient elements held, bytes of padding) between steps."""
        return 0, 0

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
