"""ZeRO stage 2: gradients sharded too: each bucket is reduce-scattered as backward fills it."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from ..config import ZeroConfig
from ..distributed.topology import ShardGroups
from ..precision import PrecisionPolicy
from .flat_params import FlatParameters
from .grad_chunks import ChunksPerBucket, GradientChunks, InPlaceChunks
from .layout import BUCKETS_PER_MODEL
from .sharded_grads import ShardedGradientStrategy
from .strategy import StageTraits, shard_ranks


class Stage2(ShardedGradientStrategy):
    """Every rank holds the whole model in one flat buffer; only this rank's gradient chunks persist.

    Gradients are reduced at every micro step ([Note: stage-2 accumulation] in
    sharding/sharded_grads.py).  Each bucket's chunk is kept for the run and the reduce-scatter sums
    into it ([Note: stage 2's own chunk is reduced in place] in sharding/grad_chunks.py).  Buckets are
    half the size of stages 0-1's, so the pool of full-size bucket buffers holds less of a full
    gradient ([Note: buckets smaller than the model] in sharding/layout.py).  After the step the
    updated chunks are all-gathered back into every rank's parameters.
    """

    traits = StageTraits(stage=2, grads_are_sharded=True, owns_whole_buckets=False, forward_communicates=False,
                         gathers_in_passes=False, needs_optimizer=True,
                         buckets_per_model=2 * BUCKETS_PER_MODEL)

    def __init__(self, storage: FlatParameters, params: Sequence[nn.Parameter], groups: ShardGroups,
                 zero: ZeroConfig, precision: PrecisionPolicy = PrecisionPolicy()) -> None:
        chunks = self.gradient_chunks(zero, precision, groups, storage)
        super().__init__(storage, params, groups, zero, precision, chunks)

    @staticmethod
    def gradient_chunks(zero: ZeroConfig, precision: PrecisionPolicy, groups: ShardGroups,
                        storage: FlatParameters) -> GradientChunks:
        """Summed in place in chunks kept for the run where the sum can accumulate there; else born
        from each reduced bucket."""
        policy = InPlaceChunks if InPlaceChunks.fits(zero.reduce_scatter, precision) else ChunksPerBucket
        return policy(precision, groups.data_parallel_size, shard_ranks(groups), storage.device)

    def hook_model(self, model: nn.Module) -> None:
        """With ``overlap_param_gather``, the post-step gather runs on into the next forward ([Note: the
        parameter gather runs into the next forward] in sharding/strategy.py)."""
        if self.zero.overlap_param_gather:
            self.defer_refresh_to_forward(model)
