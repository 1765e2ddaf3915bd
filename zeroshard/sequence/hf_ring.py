"""Ring attention on the Hugging Face path: what the wrapper of hf.py runs in place of Ulysses' exchange
when the live engine's ``sequence_parallel.mode`` is ``"ring"``.

[Note: ring attention on the Hugging Face path]
The mode is the engine's config's, the one typed policy (``SequenceAttention``, policy.py) that
``DistributedAttention`` follows too: the wrapper registered with transformers asks for it at every
forward, and the data-loader adapter asks for it at every cut (with ``load_balance`` each rank holds the
head-tail chunks of ``sequence_positions``, loader.py), so the attention and the data cannot disagree.
transformers hands the wrapper query, key and value as ``[b, heads, s/P, head_dim]`` (the rotary embedding
already applied from each slice's own position ids), the ring's own layout: the ring runs on them as they
are, key/value heads unrepeated, and never calls the model's core attention, whose arguments it must
therefore honour or refuse.  It honours ``scaling``; it refuses, before any message and so on every rank
alike, what it cannot compute: dropout, a soft cap, a sliding window, the attention weights, and a module
whose ``is_causal`` differs from ``sequence_parallel.causal``.  Like the Ulysses wrapper it drops the mask
transformers built for the slice; each row of the batch is one sequence, causal over all its positions
(packed sequences are not told apart).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..distributed.collectives import Collectives
from .groups import SequenceParallelError
from .policy import SequenceAttention
from .ring import ring_attention

__all__ = ["hf_ring_attention"]


def hf_ring_attention(comm: Collectives, attention: SequenceAttention, module: nn.Module, query: Tensor, key: Tensor,
                      value: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    """The context ``[b, heads, s/P, value's head_dim]`` of this rank's slice, by the ring over ``comm``
    ([Note: ring attention on the Hugging Face path]); ``args`` and ``kwargs``: the core attention's."""
    _refuse_what_the_ring_cannot_honour(attention, module, query, key, args, kwargs)
    return ring_attention(comm, query, key, value, attention.causal, attention.balanced, kwargs.get("scaling"))


def _refuse_what_the_ring_cannot_honour(attention: SequenceAttention, module: nn.Module, query: Tensor, key: Tensor,
                                        args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    name = type(module).__name__
    refused = []
    if args:
        refused.append(f"{len(args)} positional argument(s) for the core attention")
    if kwargs.get("dropout"):
        refused.append(f"attention dropout {kwargs['dropout']} (set the model's attention_dropout to 0)")
    for key_name in ("softcap", "sliding_window"):
        if kwargs.get(key_name) is not None:
            refused.append(f"{key_name}={kwargs[key_name]}")
    if kwargs.get("output_attentions"):
        refused.append("output_attentions (the ring never holds a whole row of weights)")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", attention.causal) if causal is None else causal
    if bool(causal) != attention.causal:
        refused.append(f"{name} is {'' if causal else 'not '}causal but sequence_parallel.causal is "
                       f"{str(attention.causal).lower()}")
    if query.dim() != 4 or key.dim() != 4 or query.shape[1] % key.shape[1]:
        refused.append(f"query {tuple(query.shape)} and key {tuple(key.shape)} are not [batch, heads, sequence, "
                       f"head_dim] with key/value heads dividing the query heads")
    if attention.balanced and query.dim() == 4 and query.shape[2] % 2:
        refused.append(f"sequence_parallel.load_balance cuts each rank's slice into two chunks, but it holds "
                       f"{query.shape[2]} positions")
    if refused:
        raise SequenceParallelError(f"UlyssesSPAttentionHF with sequence_parallel.mode \"ring\" ({name}): "
                                    + "; ".join(refused) + " (see [Note: ring attention on the Hugging Face path] "
                                    "in zeroshard/sequence/hf_ring.py)")
