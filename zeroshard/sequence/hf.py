"""Sequence parallelism for Hugging Face transformers models (DeepSpeed's ALST: ``UlyssesSPAttentionHF``).

A transformers model calls its attention through ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
with ``(module, query, key, value, attention_mask, **kwargs)``, query ``[b, heads, s, head_dim]``.
``register_with_transformers`` puts a wrapper under the name of the model's own implementation (``sdpa``,
a flash attention, ...), so every code path transformers takes for that name still runs, and only the
call to attention changes: the wrapper runs the Ulysses exchange of ``DistributedAttention`` (layer.py)
around the original function, which then sees every position of ``heads / P`` heads; or, when the live
engine's ``sequence_parallel.mode`` is ``"ring"``, the ring of ring.py in its place (hf_ring.py).

[Note: what the Hugging Face path takes from the batch]
Each rank holds a slice of every sequence (the data-loader adapter, loader.py, cuts it): the consecutive
slice, or with the ring's ``load_balance`` the head-tail chunks of ``sequence_positions``.
The model computes its rotary embedding from the ``position_ids`` it is given, so each rank's slice must
come with its own global positions, never ``arange`` of the slice: the adapter cuts ``position_ids`` with
the tokens, and they are required.  The attention mask transformers builds is for the slice's length, so
it is dropped, and the core attention runs causal over the whole sequence (``is_causal``); the positions,
gathered over the group, are handed to it whole (flash attention finds packed sequences from them).  A
batch's padding mask is therefore not applied: sequences are told apart by their position ids alone.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..distributed.collectives import Collectives
from .groups import SequenceParallelError, sequence_attention, sequence_collectives
from .hf_ring import hf_ring_attention
from .layer import DistributedAttention
from .unit import SequenceParallelUnit, sequence_parallel_unit

__all__ = ["UlyssesSPAttentionHF", "restore_transformers_attention"]

#: attention implementations that need a mask of the whole sequence, which the wrapper cannot give them
_NEEDS_A_MASK = ("eager", "paged|eager")


class UlyssesSPAttentionHF(nn.Module):
    """The Ulysses exchange around a transformers attention function (DeepSpeed's signature), or the ring
    in its place when the live engine's ``sequence_parallel.mode`` is ``"ring"`` ([Note: ring attention on
    the Hugging Face path] in zeroshard/sequence/hf_ring.py).

    ``attn``: the function from ``ALL_ATTENTION_FUNCTIONS`` (``(module, q, k, v, mask, **kw) -> (context
    [b, s, heads, d], weights)``).  Under Ulysses ``attn_head_count`` query heads must divide by the group's
    size P and ``kv_head_count`` key/value heads must divide by P or divide P (then each is repeated, as
    ``DistributedAttention`` does), refused by name at the first forward (the mode is the engine's, which
    may not exist yet here); the ring runs any head count.  ``seq_length_is_variable`` False: every slice
    holds ``local_seq_length`` positions of a ``global_seq_length`` sequence (refused by name otherwise);
    True: any length the group splits evenly.  ``disable_in_eval``: a module in eval mode attends over
    what it holds, unexchanged.  ``batch_size`` and ``num_hidden_layers`` are DeepSpeed's and are kept.
    """

    def __init__(self, attn: Callable[..., Any], batch_size: int, attn_head_count: int, attn_head_size: int,
                 kv_head_count: int, num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: Optional[int] = None, global_seq_length: Optional[int] = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size, self.num_hidden_layers = batch_size, num_hidden_layers
        self.attn_head_count, self.attn_head_size, self.global_kv_head_count = attn_head_count, attn_head_size, \
            kv_head_count
        self.seq_length_is_variable, self.disable_in_eval = seq_length_is_variable, disable_in_eval
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.core_attn_implementation: Optional[str] = None
        size = self.world_size
        if not seq_length_is_variable and (local_seq_length is None or global_seq_length != local_seq_length * size):
            raise SequenceParallelError(f"UlyssesSPAttentionHF: with seq_length_is_variable=False, global_seq_length "
                                        f"({global_seq_length}) must be {size} x local_seq_length ({local_seq_length})")
        self.layer = DistributedAttention(_CoreAttention(attn), process_group, scatter_idx=1, gather_idx=2)

    def forward(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        """``query`` ``[b, heads, s/P, d]`` (key, value with their own head count) of this rank's slice;
        returns its context ``[b, s/P, heads x d]`` and the core attention's weights (None for most)."""
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)  # type: ignore[no-any-return]
        comm = sequence_collectives(self.process_group, query.device)
        if comm is None or comm.world.world_size == 1:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)  # type: ignore[no-any-return]
        self._check_slice(query)
        if kwargs.get("position_ids") is None:
            raise SequenceParallelError(
                "UlyssesSPAttentionHF needs position_ids in every forward (each slice's global positions, which "
                "UlyssesSPDataLoaderAdapter cuts with the tokens): see [Note: what the Hugging Face path takes "
                "from the batch] in zeroshard/sequence/hf.py")
        attention = sequence_attention()
        batch, _, local, _ = query.shape
        if attention.ring:
            context = hf_ring_attention(comm, attention, module, query, key, value, args, kwargs)
            return context.transpose(1, 2).reshape(batch, local, -1), None
        self._check_heads()
        kwargs["position_ids"] = _gathered_positions(comm, kwargs["position_ids"])
        weights: list[Any] = []
        context = self.layer(query, key, value, module, attention_mask, weights, *args, **kwargs)
        return context.transpose(1, 2).reshape(batch, local, -1), (weights[0] if weights else None)

    def _check_heads(self) -> None:
        """Ulysses splits the heads over the group (the ring does not): refused by name, on every rank alike,
        head counts it cannot split."""
        size = self.world_size
        if self.attn_head_count % size:
            raise SequenceParallelError(f"UlyssesSPAttentionHF: {self.attn_head_count} attention heads do not split "
                                        f"over sequence_parallel_size {size} (sequence_parallel.mode \"ring\" runs any "
                                        f"head count)")
        if self.global_kv_head_count % size and size % self.global_kv_head_count:
            raise SequenceParallelError(f"UlyssesSPAttentionHF: {self.global_kv_head_count} key/value heads neither "
                                        f"divide by sequence_parallel_size {size} nor divide it")

    def _check_slice(self, query: Tensor) -> None:
        """A fixed-length run's slice must be the length it was registered with (every rank of the group
        holds the same length, so every rank refuses alike)."""
        if not self.seq_length_is_variable and query.shape[2] != self.local_seq_length:
            raise SequenceParallelError(
                f"UlyssesSPAttentionHF: this slice holds {query.shape[2]} positions, but seq_length_is_variable=False "
                f"registered {self.local_seq_length} per rank ({self.global_seq_length} in all)")

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int,
                                   seq_length: Optional[int] = None, seq_length_is_variable: bool = True,
                                   disable_in_eval: bool = False, max_length: Optional[int] = None,
                                   ) -> Optional[SequenceParallelUnit]:
        """Wrap transformers' ``core_attn_implementation`` in Ulysses' exchange over ``sequence_parallel_size``
        consecutive ranks (or the ring, as the engine's ``sequence_parallel.mode`` says), and return the unit
        (``mpu``) of those groups for ``initialize(mpu=...)``; None (nothing registered) at a size of 1.
        ``model_name_or_path``: the model (its ``config``) or a name/path ``AutoConfig`` reads.
        ``max_length`` is the old name of ``seq_length``.  Registering again replaces the previous wrapper
        (it never wraps a wrapper)."""
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise SequenceParallelError("register_with_transformers: seq_length_is_variable=False needs seq_length")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        config = model_name_or_path.config if hasattr(model_name_or_path, "config") \
            else AutoConfig.from_pretrained(model_name_or_path)
        _check_implementation(config, core_attn_implementation, ALL_ATTENTION_FUNCTIONS)
        unit = sequence_parallel_unit(sequence_parallel_size)
        text = config.get_text_config()
        size = unit.get_sequence_parallel_world_size()
        if seq_length is not None and seq_length % size:
            raise SequenceParallelError(f"register_with_transformers: seq_length {seq_length} does not split over "
                                        f"sequence_parallel_size {size}")
        core = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        attention = cls(getattr(core, "zeroshard_core", core), micro_batch_size, text.num_attention_heads,
                        getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                        text.num_key_value_heads, text.num_hidden_layers, unit.get_sequence_parallel_group(),
                        seq_length_is_variable=seq_length_is_variable,
                        local_seq_length=None if seq_length_is_variable or seq_length is None else seq_length // size,
                        global_seq_length=None if seq_length_is_variable else seq_length,
                        disable_in_eval=disable_in_eval)
        attention.core_attn_implementation = core_attn_implementation
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = _wrapper(attention)
        return unit


def restore_transformers_attention(core_attn_implementation: str) -> None:
    """Put transformers' own function back under ``core_attn_implementation`` (zeroshard's: undoes
    ``register_with_transformers``, for a model that attends over whole sequences again)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS.get(core_attn_implementation)
    core = getattr(current, "zeroshard_core", None)
    if core is not None:
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = core


def _check_implementation(config: Any, name: str, functions: Any) -> None:
    """Refuse, on every rank alike, an implementation the wrapper cannot stand in for."""
    own = getattr(config, "_attn_implementation", None)
    if own is not None and own != name:
        raise SequenceParallelError(f"register_with_transformers: core_attn_implementation={name!r} but the model's "
                                    f"config says attn_implementation={own!r}; the wrapper replaces the one the model "
                                    f"calls, so they must be the same")
    if name in _NEEDS_A_MASK:
        raise SequenceParallelError(f"register_with_transformers: {name!r} attention needs a mask of the whole "
                                    f"sequence; use 'sdpa', 'flex_attention' or a flash attention")
    if name not in functions:
        raise SequenceParallelError(f"register_with_transformers: {name!r} is not an attention implementation of "
                                    f"transformers' (known: {sorted(functions.valid_keys())})")


def _wrapper(attention: UlyssesSPAttentionHF) -> Callable[..., Any]:
    """The function registered under the model's implementation: the mask transformers built for the
    slice dropped ([Note: what the Hugging Face path takes from the batch]), Ulysses around the core."""

    def ulysses_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                          *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        return attention(module, query, key, value, None, *args, **kwargs)  # type: ignore[no-any-return]

    ulysses_attention.zeroshard_core = attention.attn  # type: ignore[attr-defined]
    ulysses_attention.zeroshard_attention = attention  # type: ignore[attr-defined]
    return ulysses_attention


class _CoreAttention(nn.Module):
    """transformers' attention function as ``DistributedAttention``'s local attention: ``[b, heads/P, s, d]``
    in and out (the function returns ``[b, s, heads/P, d]``); the module's key/value grouping set, for the
    call, to the heads this rank holds (repeated key/value heads change it)."""

    def __init__(self, attn: Callable[..., Any]) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, query: Tensor, key: Tensor, value: Tensor, module: nn.Module, attention_mask: Any,
                weights: list[Any], *args: Any, **kwargs: Any) -> Tensor:
        groups = query.shape[1] // key.shape[1]
        own = getattr(module, "num_key_value_groups", None)
        if own is not None:
            setattr(module, "num_key_value_groups", groups)
        try:
            context, attn_weights = self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        finally:
            if own is not None:
                setattr(module, "num_key_value_groups", own)
        weights.append(attn_weights)
        return context.transpose(1, 2)


def _gathered_positions(comm: Collectives, positions: Tensor) -> Tensor:
    """``[b, s/P]`` position ids of every rank of the group, side by side: ``[b, s]``."""
    size = comm.world.world_size
    shard = positions.contiguous().view(-1)
    full = torch.empty(size * shard.numel(), dtype=shard.dtype, device=shard.device)
    comm.all_gather(full, shard, "sequence_position_ids")
    return full.view(size, *positions.shape).movedim(0, -2).flatten(-2)
