"""The gradient norm of a model whose layers are split across tensor-parallel ranks (an engine part:
``GradientNorm`` in engine/parts.py).

[Note: split and replicated parameters in the norm]
Under tensor parallelism each rank of a tensor-parallel group holds part of some parameters (a
column-parallel weight's rows, a row-parallel weight's columns) and a whole copy of the others (a
row-parallel layer's bias, norms, an embedding kept whole), with the same gradient on every rank of
the group.  The norm of the whole model adds the squares of every split part once and of every
replicated parameter once: each rank sums its split parameters' squares, the first rank of the group
adds the replicated ones', and the sums are added over the group.  Which parameters are split is the
model's to say: Megatron marks them ``tensor_model_parallel=True`` and DeepSpeed's older layers
``model_parallel=True``; an unmarked parameter is a replicated one.  zeroshard reads these marks and
never sets them; the layers it splits itself (``tensor_parallel.autotp_size``) it knows by identity.  The squares are summed in float64 on the device, as [Note: the norm stays on the
device] in optim/clipping.py explains, and summed over the ZeRO shard group before the tensor group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Collection, Optional, Sequence

import torch

from ..distributed.collectives import Collectives
from ..sharding.layout import BucketLayout

if TYPE_CHECKING:
    from ..sharding import ShardingStrategy
    from .slices import TensorAxis

#: the attributes a tensor-parallel model sets on the parameters it splits (Megatron's, DeepSpeed's)
SPLIT_MARKS = ("tensor_model_parallel", "model_parallel")


def is_split(param: torch.Tensor) -> bool:
    """Whether the model marked ``param`` as split across its tensor-parallel group."""
    return any(bool(getattr(param, mark, False)) for mark in SPLIT_MARKS)


#: runs of a bucket's owned chunk, ``(lo, hi, split)``, relative to the chunk
Runs = tuple[tuple[int, int, bool], ...]


class TensorParallelNorm:
    """The global gradient norm over ZeRO shards and tensor-parallel ranks (see [Note: split and
    replicated parameters in the norm])."""

    def __init__(self, buckets: Sequence[BucketLayout], params: Sequence[torch.Tensor], tensor: Collectives,
                 split: Optional[Collection[int]], shard_rank: int, device: torch.device) -> None:
        """``split``: the ids of the split parameters, where zeroshard split them (else the model's marks);
        ``shard_rank``: this rank's index in its shard group."""
        self.buckets = list(buckets)
        self.split = [id(p) in split if split is not None else is_split(p) for p in params]
        self.tensor = tensor
        self.shard_rank = shard_rank
        self.device = device
        self._runs: dict[tuple[int, int, int], Runs] = {}

    @staticmethod
    def over(axis: "TensorAxis", strategy: "ShardingStrategy", device: torch.device) -> "TensorParallelNorm":
        """The norm of an engine's model over ``axis``'s group (a ``NormBuilder``, engine/parts.py)."""
        return TensorParallelNorm(strategy.layout.buckets, strategy.params, axis.comm,
                                  axis.split.split if axis.split is not None else None, strategy.comm.world.rank,
                                  device)

    def __call__(self, grads: Sequence[torch.Tensor], shard_comm: Optional[Collectives]) -> torch.Tensor:
        """The norm, a float64 tensor of one element; ``shard_comm``: the owned chunks are ZeRO shards."""
        shard_rank = self.shard_rank
        where = grads[0].device if grads else self.device
        split = torch.zeros(1, dtype=torch.float64, device=where)
        whole = torch.zeros(1, dtype=torch.float64, device=where)
        counts_whole = self.tensor.world.rank == 0
        for bucket, grad in zip(self.buckets, grads):
            for lo, hi, is_split_run in self._runs_of(bucket, grad.numel(), shard_rank):
                if is_split_run or counts_whole:
                    square = torch.linalg.vector_norm(grad[lo:hi], dtype=torch.float32).double().square()
                    (split if is_split_run else whole).add_(square)
        total = split.add_(whole)
        if shard_comm is not None:
            shard_comm.all_reduce(total, "grad_norm")
        if self.tensor.world.is_distributed:
            self.tensor.all_reduce(total, "tensor_parallel_grad_norm")
        return total.sqrt_()

    def _runs_of(self, bucket: BucketLayout, chunk_numel: int, shard_rank: int) -> Runs:
        """The owned chunk cut into runs of split and of replicated parameters (computed once)."""
        key = (bucket.index, chunk_numel, shard_rank)
        if key not in self._runs:
            start = bucket.chunk_start(chunk_numel, shard_rank)
            runs: list[tuple[int, int, bool]] = []
            for slot in bucket.slots:
                lo, hi = max(slot.offset, start) - start, min(slot.offset + slot.numel, start + chunk_numel) - start
                if lo >= hi:
                    continue
                kind = self.split[slot.index]
                if runs and runs[-1][2] == kind and runs[-1][1] == lo:
                    runs[-1] = (runs[-1][0], hi, kind)
                else:
                    runs.append((lo, hi, kind))
            self._runs[key] = tuple(runs)
        return self._runs[key]
