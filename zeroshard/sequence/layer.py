"""DeepSpeed-Ulysses' attention: ``DistributedAttention`` (DeepSpeed's ``deepspeed.sequence.layer``).

Each rank of a sequence-parallel group of P ranks holds a slice of every sequence.  Attention needs the
whole sequence, so the layer trades the sequence split for a head split (sequence/all_to_all.py), runs
the local attention on every position of H / P heads, and trades the split back.  With the config's
``sequence_parallel.mode`` ``"ring"`` it computes the attention by a ring instead (sequence/ring.py):
the keys and values travel round the group, and no split by heads bounds the degree.  Everything else in
the model (embeddings, projections, MLP, norms, loss) works position by position on the local slice.

[Note: the loss and the gradient average under sequence parallelism]
The ranks of a sequence group hold the same parameters and see different tokens of the same sequences,
so ZeRO treats them as data-parallel ranks: its world is data x sequence (``dp * sp`` ranks, see [Note:
the order of the axes] in distributed/parallel_dims.py) and the gradient reduction averages over all of
them, as DeepSpeed-Ulysses does.  Each rank's loss is the mean over its own tokens.  A rank's backward
then yields the gradient of the sum of the group's losses with respect to the parameters it used: the
all-to-all's backward carries the gradient of every rank's loss to the ranks that computed its heads,
and back to the ranks whose positions produced them.  Summed over the ``sp`` ranks of a group that is
the gradient of ``sp`` times the group's mean loss (each rank's mean is over ``1/sp`` of the group's
tokens); the average over ``dp * sp`` ranks divides by ``sp`` again, which leaves the gradient of the
mean over every token of the global batch, what one process training on the whole sequences computes.
This holds when every rank holds the same number of counted tokens (equal slices, no padding left out
of the mean).  With uneven counts every rank takes the group's mean instead, from the ranks' sums and
counts combined over the group: the combination's backward hands each rank's sum P times its share of
the gradient, and the same average over ``dp * sp`` ranks divides the P out (see [Note: a loss over the
group's counted tokens] in sequence/loss.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..distributed.collectives import Collectives
from .all_to_all import sequence_all_to_all
from .groups import SequenceParallelError, sequence_attention, sequence_collectives
from .policy import SequenceAttention
from .ring import ring_attention

__all__ = ["DistributedAttention"]


class DistributedAttention(nn.Module):
    """Attention over sequences split across ranks (DeepSpeed-Ulysses), DeepSpeed's signature.

    ``local_attention(query, key, value, *args, **kwargs)`` is any attention over whole sequences (torch's
    ``scaled_dot_product_attention`` behind a layout change, flash attention, ...).  The inputs are
    ``[s/P, b, heads, head_dim]`` (``gather_idx=0``, Megatron's layout) or ``[b, s/P, heads, head_dim]``
    (``gather_idx=1``); ``scatter_idx`` is the heads' dimension (2).  The local attention receives
    ``[s, b, heads/P, head_dim]`` (or ``[b, s, heads/P, head_dim]``) and returns its context in the same
    layout; the layer returns it as ``[s/P, b, heads, head_dim]`` (or ``[b, s/P, ...]``).  Rank ``r`` of the
    group holds the ``r``-th consecutive slice of each sequence.

    ``sequence_process_group``: the group that splits each sequence; None (zeroshard's) means the live
    engine's (``sequence_parallel_size`` in the config), looked up at every forward, so a model can be
    built before ``initialize()``; with no engine of a sequence axis the sequence is whole and the layer is
    the local attention.  The number of query heads must divide by P (refused by name otherwise, before
    any exchange, so every rank of the group raises).  Grouped-query attention with fewer key/value heads
    than P replicates each key/value head ``P / kv_heads`` times before the exchange, so that each rank
    receives the one its query heads use (refused when neither divides the other).

    With ``sequence_parallel.mode`` ``"ring"`` in the live engine's config, the layer computes
    ``softmax(q k^T / sqrt(head_dim)) v`` itself by a ring over the group (sequence/ring.py; causal as
    ``sequence_parallel.causal`` says; with ``sequence_parallel.load_balance`` each rank holds the
    positions ``sequence_positions`` gives) and does not call the local attention, whose extra arguments
    are then refused; any number of heads runs at any degree, key/value heads dividing the query heads.
    """

    def __init__(self, local_attention: nn.Module, sequence_process_group: Any = None, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None) -> None:
        super().__init__()
        if sp_stream is not None:
            raise SequenceParallelError("DistributedAttention(sp_stream=...): overlapping the exchanges on a side "
                                        "stream is not supported; pass None")
        if scatter_idx == gather_idx:
            raise SequenceParallelError(f"DistributedAttention: scatter_idx and gather_idx are both {scatter_idx}")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx

    def forward(self, query: Tensor, key: Tensor, value: Tensor, *args: Any, batch_dim_idx: Optional[int] = None,
                rotary_pos_emb: Any = None, **kwargs: Any) -> Tensor:
        """The context of ``query`` over the whole sequences, in the inputs' layout; ``args`` and ``kwargs``
        go to the local attention, as DeepSpeed's ``forward(query, key, value, *args, **kwargs)`` hands them
        on.  ``batch_dim_idx`` (DeepSpeed's newer argument, taken here by keyword only: a fourth positional
        argument goes to the local attention) must be the dimension the layout already says, the one of
        0 and 1 that ``gather_idx`` (the sequence's) is not."""
        if rotary_pos_emb is not None:
            raise SequenceParallelError("DistributedAttention(rotary_pos_emb=...) is not supported: apply the "
                                        "rotary embedding to query and key before the layer")
        if batch_dim_idx is not None and batch_dim_idx != 1 - self.gather_idx:
            raise SequenceParallelError(f"DistributedAttention: batch_dim_idx={batch_dim_idx} with gather_idx="
                                        f"{self.gather_idx} (the sequence's dimension); the batch is dimension "
                                        f"{1 - self.gather_idx}")
        comm = sequence_collectives(self.spg, query.device)
        if comm is None or comm.world.world_size == 1:
            return self.local_attn(query, key, value, *args, **kwargs)
        attention = sequence_attention()
        if attention.ring:
            return self._ring(comm, attention, query, key, value, args, kwargs)
        query = self._heads_for(comm, query, "query")  # before any exchange: every rank refuses alike
        key, value = self._heads_for(comm, key, "key"), self._heads_for(comm, value, "value")
        scatter, gather = self.scatter_idx, self.gather_idx
        q, k, v = (sequence_all_to_all(comm, t, scatter, gather, f"sequence_{name}")
                   for t, name in ((query, "query"), (key, "key"), (value, "value")))
        context = self.local_attn(q, k, v, *args, **kwargs)
        return sequence_all_to_all(comm, context, gather, scatter, "sequence_context")

    def _ring(self, comm: Collectives, attention: SequenceAttention, query: Tensor, key: Tensor, value: Tensor,
              args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        """The attention by a ring: the inputs turned to ``[b, heads, s/P, head_dim]`` and the context
        turned back to their layout.  Refused, before any message, what the ring cannot honour."""
        if args or kwargs:
            raise SequenceParallelError(
                "DistributedAttention: with sequence_parallel.mode \"ring\" the ring computes the attention "
                "itself and cannot hand arguments to the local attention; pass query, key and value alone")
        if query.dim() != 4 or self.scatter_idx % 4 == 3 or self.gather_idx % 4 == 3:
            raise SequenceParallelError(
                f"DistributedAttention: the ring takes 4-dimensional inputs with the head dimension last "
                f"(query {tuple(query.shape)}, scatter_idx={self.scatter_idx}, gather_idx={self.gather_idx})")
        heads, seq = self.scatter_idx % 4, self.gather_idx % 4
        order = [3 - heads - seq, heads, seq, 3]  # batch, heads, sequence, head_dim
        if query.shape[heads] % key.shape[heads]:
            raise SequenceParallelError(
                f"DistributedAttention: {query.shape[heads]} query heads are not a multiple of "
                f"{key.shape[heads]} key/value heads")
        if attention.balanced and query.shape[seq] % 2:
            raise SequenceParallelError(
                f"DistributedAttention: sequence_parallel.load_balance cuts each rank's slice into two chunks, but "
                f"it holds {query.shape[seq]} positions (dimension {seq} of {tuple(query.shape)})")
        context = ring_attention(comm, query.permute(order), key.permute(order), value.permute(order),
                                 attention.causal, attention.balanced)
        return context.permute(torch.argsort(torch.tensor(order)).tolist())

    def _heads_for(self, comm: Collectives, values: Tensor, name: str) -> Tensor:
        """``values`` with heads that split over the group: as they are when they divide by its size,
        each head repeated when fewer heads than ranks divide it (grouped-query key/value heads);
        refused by name otherwise."""
        size, heads = comm.world.world_size, values.shape[self.scatter_idx]
        if heads % size == 0:
            return values
        if name != "query" and size % heads == 0:
            return values.repeat_interleave(size // heads, dim=self.scatter_idx)
        raise SequenceParallelError(
            f"DistributedAttention: {heads} {name} heads (dimension {self.scatter_idx} of {tuple(values.shape)}) "
            f"do not split over sequence_parallel_size {size}: the number of heads must be a multiple of it"
            + ("" if name == "query" else " or divide it"))
