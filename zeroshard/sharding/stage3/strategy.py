"""ZeRO stage 3: parameters sharded too; each unit is gathered just before it computes, then released.

Gradients travel as at stage 2 (one reduce-scatter per bucket into this rank's shard, the code both
share in :mod:`..sharded_grads`), each bucket's chunk in a buffer of its own whose pages go at the step
(:class:`~..grad_chunks.KeptChunkBuffers`), and the optimizer updates this rank's chunks in place; what
stage 3 adds is parameter storage that holds only those chunks (:mod:`.sharded_params`), the gather
units (:mod:`.units`) and the hooks that gather, prefetch and release them (:mod:`.gather_scheduler`).
Where a parameter is gathered: :meth:`ShardedParameters.gather`, called from :meth:`GatherScheduler.use`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Optional, Sequence

import torch
from torch import nn

from ...config import ZeroConfig
from ...distributed.topology import ShardGroups
from ...host.buffer_memory import BufferMemory
from ...logging import log_rank
from ...offload.policy import OffloadPolicies, Place
from ...precision import PrecisionPolicy
from .gather_agreement import GatherAgreement, parameters_reached
from .gather_scheduler import GatherScheduler
from ..grad_chunks import KeptChunkBuffers
from ..layout import BucketLayout
from .quantised_gathers import qwz_gathers
from .sharded_params import ShardedParameters
from ..sharded_grads import ShardedGradientStrategy
from ..storage import InitialValues
from ..strategy import BucketProgress, StageTraits, shard_ranks
from .units import Stage3Plan, plan_units


class Stage3(ShardedGradientStrategy):
    """Stage 2's gradient path over stage 3's sharded parameter storage.

    Only persistent buckets are gathered after the step (the rest are gathered for use), and one
    launched bucket is kept in flight: a bucket is a whole unit here, so fewer full-size ones stay
    alive.  Gathers happen inside forward and backward (``traits.gathers_in_passes``): the engine
    builds the groups their rounds need ([Note: ranks agree on every gather] in
    sharding/stage3/gather_agreement.py).
    """

    traits = StageTraits(stage=3, grads_are_sharded=True, owns_whole_buckets=False, forward_communicates=True,
                         gathers_in_passes=True, shards_parameters=True,
                         max_buckets_in_flight=1)
    storage: ShardedParameters
    grad_chunks: KeptChunkBuffers

    def __init__(self, storage: ShardedParameters, params: Sequence[nn.Parameter], groups: ShardGroups,
                 zero: ZeroConfig, plan: Stage3Plan, model: nn.Module,
                 precision: PrecisionPolicy = PrecisionPolicy()) -> None:
        # the gradient reduce-scatters on a group of their own, apart from the gathers
        grad_groups = dataclasses.replace(groups, shard=groups.grads or groups.shard,
                                          expert_data=groups.expert_grads or groups.expert_data)
        # each bucket's chunk in a buffer of its own whose memory goes at the step, through the storage's
        # buffer memory (see [Note: where gradient chunks live] in sharding/grad_chunks.py)
        chunks = KeptChunkBuffers(precision, grad_groups.data_parallel_size, shard_ranks(grad_groups),
                                  storage.device, storage.buffer_memory)
        super().__init__(storage, params, grad_groups, zero, precision, chunks)
        self.plan = plan
        agreement = GatherAgreement(groups.rounds) if groups.rounds is not None else None
        self.scheduler = GatherScheduler(storage, plan.units, zero, model, agreement)
        #: whether every rank's backward is over, so that waiting for a reduction cannot deadlock
        self._rounds_over = True

    def gather_scheduler(self) -> GatherScheduler:
        return self.scheduler

    @classmethod
    def build(cls, model: nn.Module, params: Sequence[nn.Parameter], names: Sequence[str],
              group_of: Sequence[int], groups: ShardGroups, zero: ZeroConfig,
              precision: PrecisionPolicy = PrecisionPolicy(), offload: OffloadPolicies = OffloadPolicies(),
              initial: InitialValues = InitialValues(), frozen: Sequence[tuple[str, nn.Parameter]] = (),
              *, buffer_memory: BufferMemory, experts: Collection[int] = (),
              interleaved_groups: bool = False) -> "Stage3":
        """Stage 3's units over sharded storage; frozen parameters above the persistence threshold
        are sharded too (see [Note: frozen parameters at stage 3] in sharding/stage3/units.py).  A unit's
        buckets are its own parameters' (one per group); ``interleaved_groups``: see :func:`plan_units`."""
        comm = groups.shard
        spread = groups.expert_data.world.world_size if groups.expert_data is not None else 0
        plan = plan_units(model, params, names, group_of, zero.stage3_param_persistence_threshold,
                          zero.reduce_bucket_size, comm.world.world_size, frozen, experts, spread, interleaved_groups)
        masters = cls.make_masters(plan.layout.trainable(), shard_ranks(groups), precision, offload, params[0].device, comm)
        storage = ShardedParameters(plan.layout, plan.params, comm, model, buffer_memory, plan.persistent_buckets,
                                    precision.compute, masters, offload.params, initial, groups.secondary,
                                    groups.job, groups.expert_data)
        quantised = qwz_gathers(plan.layout, plan.persistent_buckets, zero)  # ZeRO++'s qwZ
        if quantised is not None:
            storage.compress_gathers(quantised)
            log_rank(f"zero++: stage 3 gathers {len(quantised.buckets)} buckets as int8 blocks of "
                     f"{quantised.format.block} for compute")
        return cls(storage, params, groups, zero, plan, model, precision)


    def before_forward(self) -> None:
        self.scheduler.release_all()
        self.scheduler.begin_pass()

    def grad_arrived(self, bucket: BucketLayout, progress: BucketProgress) -> None:
        if progress.complete(bucket) and bucket.index in self.scheduler.units:
            self.scheduler.done_with(bucket.index)

    def may_block(self) -> bool:
        """Not while another rank may be in a gather round of this backward."""
        return self.scheduler.agreement is None or self._rounds_over

    def expect_gradients(self, loss: torch.Tensor) -> None:
        """Parameters this backward's graph does not reach get no gradient: their slots count as
        arrived (zeros) from the start, so a rank that skipped a module reduces its bucket when the
        others do, not at the end of backward (DDP's ``find_unused_parameters`` does the same)."""
        self._rounds_over = False
        if self.scheduler.agreement is None or not self.communicates_now():
            return
        reached: Optional[set[int]] = parameters_reached(loss)
        if reached is None:
            return
        for index, param in enumerate(self.params):
            if id(param) not in reached:
                bucket, _ = self._slot_of[index]
                self._progress[bucket.index].absent.add(index)
        self._launch_in_order(only_complete=True)

    def finish_backward(self) -> None:
        """Answer the other ranks' gather rounds until every backward is over, then reduce what is left;
        release every unit, and give back the gradient buckets: stage 3 is the memory-first stage,
        and the next forward (whose peak adds the gathered units to the activations) does not need them."""
        self.scheduler.finish_pass()
        self._rounds_over = True
        super().finish_backward()
        self.scheduler.release_all()

    def refresh_bucket(self, bucket: BucketLayout) -> None:
        """Persistent buckets are whole on every rank: gather their update; the rest waits for use."""
        if bucket.index in self.plan.persistent_buckets:
            super().refresh_bucket(bucket)

    def param_bytes(self) -> tuple[int, int]:
        size = self.storage.shard.element_size()
        real = self.owned_real_numel()
        return real * size, (self.layout.shard_numel() - real) * size

    def frozen_bytes(self) -> tuple[int, int]:
        """(bytes of real frozen elements in this rank's chunks, bytes of their padding)."""
        size = self.storage.shard.element_size()
        frozen = [b for b in self.storage.layout.buckets if b.frozen]
        real = sum(b.real_numel_in_shard(self.ranks.of(b)) for b in frozen)
        return real * size, sum(b.shard_numel for b in frozen) * size - real * size

    def param_placement(self) -> tuple[int, int]:
        size = self.storage.shard.element_size()
        store, ranks = self.storage.store, self.ranks
        return store.real_numel_at(Place.HOST, ranks) * size, store.real_numel_at(Place.NVME, ranks) * size

    def publish_piece(self, bucket: BucketLayout, start: int, values: torch.Tensor) -> None:
        """The owned chunk may be off the device (parameter offload): the store writes it in place."""
        self.storage.take_back_chunk(bucket.index)  # a lent chunk would be copied back over the update
        with torch.no_grad():
            self.storage.store.write(bucket, start, values)

    def finish_refresh(self) -> None:
        """After a step (or a load): the owned chunks changed, so hpZ's secondary partition is stale."""
        super().finish_refresh()
        self.storage.store.flush()  # updated chunks written to NVMe before the next forward reads them
        self.storage.drop_secondary()

    def extra_memory(self) -> dict[str, Any]:
        out = {**super().extra_memory(), "persistent_params": self.storage.persistent_bytes(),
               "gathered_params": self.storage.gathered_bytes(),
               # released pages waiting for the next gather (see host/page_reserve.py; none on a device)
               "parked_pages": self.storage.buffer_memory.parked_bytes}
        if self.storage.secondary is not None:
            out["secondary_params"] = self.storage.secondary_bytes()
        if self.storage.compressed is not None:  # transient: one packed gather's chunks at a time
            out[self.storage.compressed.memory_key] = self.storage.compressed.buffer_bytes()
        return out

    def remove_hooks(self) -> None:
        super().remove_hooks()
        self.scheduler.remove_hooks()
