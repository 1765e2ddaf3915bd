"""Sequence parallelism's pieces that need no world: the config keys, the axes it combines with,
``DistributedAttention`` without a sequence group, and the ring of one rank (the world of several ranks is
tests/distributed/test_sequence_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroshard.config import ConfigError, load_config
from zeroshard.deepspeed.utils import groups as ds_groups
from zeroshard.distributed.collectives import Collectives
from zeroshard.distributed.parallel_dims import ParallelDims, SequenceParallelSizeError
from zeroshard.distributed.world import World
from zeroshard.sequence import DistributedAttention, SequenceParallelError, check_sequence_axes
from zeroshard.sequence.ring import ring_attention, sequence_positions


class Doubling(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return scale * (q + k + v)


def test_the_config_key_is_top_level_and_positive() -> None:
    assert load_config({"train_micro_batch_size_per_gpu": 1}).sequence_parallel_size == 1
    assert load_config({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 4}).sequence_parallel_size == 4
    with pytest.raises(ConfigError, match="sequence_parallel_size"):
        load_config({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 0})


def test_a_degree_that_does_not_divide_the_world_is_refused_by_name() -> None:
    with pytest.raises(SequenceParallelSizeError, match="sequence_parallel_size = 3 does not divide the 4 ranks"):
        ParallelDims.for_job(4, sp=3)
    axes = ParallelDims.for_job(8, sp=2)
    assert (axes.dp, axes.sp, axes.zero_size) == (4, 2, 8)
    assert axes.positions("sequence") == [(0, 1), (2, 3), (4, 5), (6, 7)]


@pytest.mark.parametrize("sizes, named", [({"pp": 2}, "pipeline parallelism"), ({"tp": 2}, "tensor parallelism"),
                                          ({"ep": 2}, "expert parallelism")])
def test_axes_sequence_parallelism_does_not_combine_with_yet_are_refused(sizes: dict, named: str) -> None:
    axes = ParallelDims.for_job(8, sp=2, **sizes)
    with pytest.raises(SequenceParallelError, match=f"sequence_parallel_size = 2 with {named}"):
        check_sequence_axes(axes)
    check_sequence_axes(ParallelDims.for_job(8, **sizes))  # without a sequence axis: nothing to refuse


def test_an_mpu_beside_a_sequence_axis_is_refused() -> None:
    with pytest.raises(SequenceParallelError, match="tensor parallelism"):
        check_sequence_axes(ParallelDims.for_job(4, sp=2), model_parallel=True)
    check_sequence_axes(ParallelDims.for_job(4, sp=2))


def test_without_a_sequence_group_the_layer_is_the_local_attention() -> None:
    layer = DistributedAttention(Doubling(), None, scatter_idx=2, gather_idx=1)
    q = torch.randn(2, 5, 3, 4)
    torch.testing.assert_close(layer(q, q, q, 2.0), 6.0 * q)
    torch.testing.assert_close(layer(q, q, q, scale=0.5, batch_dim_idx=0), 1.5 * q)
    with pytest.raises(SequenceParallelError, match="batch_dim_idx=1 with gather_idx=1"):
        layer(q, q, q, batch_dim_idx=1)
    with pytest.raises(SequenceParallelError, match="rotary_pos_emb"):
        layer(q, q, q, rotary_pos_emb=(q, q))
    with pytest.raises(SequenceParallelError, match="sp_stream"):
        DistributedAttention(Doubling(), None, sp_stream=object())


def test_head_tail_positions() -> None:
    assert sequence_positions(8, 0, 2).tolist() == [0, 1, 2, 3]
    assert sequence_positions(8, 0, 2, balanced=True).tolist() == [0, 1, 6, 7]
    assert sequence_positions(8, 1, 2, balanced=True).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="does not cut into 4 equal chunks"):
        sequence_positions(6, 0, 2, balanced=True)


def test_the_deepspeed_accessors_answer_a_degree_of_one_without_an_engine() -> None:
    assert ds_groups._get_sequence_parallel_group() is None
    assert ds_groups._get_sequence_parallel_world_size() == 1
    assert ds_groups._get_sequence_parallel_rank() == 0
    assert ds_groups._get_sequence_data_parallel_world_size() == 1
    assert ds_groups._get_sequence_data_parallel_rank() == 0


def test_the_mode_block_is_checked_strictly() -> None:
    base = {"train_micro_batch_size_per_gpu": 1}
    block = load_config(base).sequence_parallel
    assert (block.mode, block.causal) == ("ulysses", True)
    ring = load_config({**base, "sequence_parallel": {"mode": "ring", "causal": False}}).sequence_parallel
    assert (ring.mode, ring.causal) == ("ring", False)
    with pytest.raises(ConfigError, match="sequence_parallel.mode"):
        load_config({**base, "sequence_parallel": {"mode": "context"}})
    with pytest.raises(ConfigError, match="sequence_parallel"):
        load_config({**base, "sequence_parallel": {"mode": "ring", "chunks": 2}})
    with pytest.raises(ConfigError, match="has no effect with mode \"ulysses\""):
        load_config({**base, "sequence_parallel": {"causal": False}})
    with pytest.raises(ConfigError, match="load_balance' needs 'sequence_parallel.mode' \"ring\""):
        load_config({**base, "sequence_parallel": {"load_balance": True}})


@pytest.mark.parametrize("causal, balanced", [(True, False), (False, False), (True, True)])
def test_the_ring_of_one_rank_is_attention_forward_and_backward(causal: bool, balanced: bool) -> None:
    """One rank's ring is one block (two chunks, merged pair by pair, with ``balanced``): its online
    softmax and recomputed backward against torch's, with grouped key/value heads (the world of several
    ranks is tests/distributed/test_sequence_parallel.py)."""
    comm = Collectives(World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none"))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 6, 3, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    assert sequence_positions(6, 0, 1, balanced).tolist() == list(range(6))
    out = ring_attention(comm, q, k, v, causal, balanced)
    expected = nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                          is_causal=causal)
    torch.testing.assert_close(out, expected)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    torch.testing.assert_close(grads, torch.autograd.grad(expected, (q, k, v), grad))


def test_the_ring_takes_a_scale() -> None:
    """``scale`` (transformers' ``scaling``) replaces ``1 / sqrt(head_dim)``, forward and backward."""
    comm = Collectives(World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none"))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4, 3, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
    out = ring_attention(comm, q, k, v, True, scale=0.3)
    expected = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), (q, k, v)),
                               torch.autograd.grad(expected.sum(), (q, k, v)))


@pytest.mark.parametrize("kwargs, named", [
    ({"dropout": 0.1}, "attention dropout 0.1"), ({"softcap": 30.0}, "softcap=30.0"),
    ({"sliding_window": 8}, "sliding_window=8"), ({"output_attentions": True}, "output_attentions"),
    ({"is_causal": False}, "is not causal but sequence_parallel.causal is true")])
def test_the_hugging_face_ring_refuses_what_it_cannot_honour(kwargs: dict, named: str) -> None:
    """Refused before any message (so on every rank alike), each by name ([Note: ring attention on the
    Hugging Face path] in zeroshard/sequence/hf_ring.py)."""
    from zeroshard.sequence.hf_ring import hf_ring_attention
    from zeroshard.sequence.policy import SequenceAttention

    q, kv = torch.zeros(1, 4, 6, 8), torch.zeros(1, 2, 6, 8)
    with pytest.raises(SequenceParallelError, match=named):
        hf_ring_attention(None, SequenceAttention(ring=True), nn.Module(), q, kv, kv,  # type: ignore[arg-type]
                          (), {"position_ids": None, **kwargs})


def test_the_hugging_face_ring_refuses_a_slice_head_tail_sharding_does_not_halve() -> None:
    from zeroshard.sequence.hf_ring import hf_ring_attention
    from zeroshard.sequence.policy import SequenceAttention

    q, kv = torch.zeros(1, 4, 5, 8), torch.zeros(1, 2, 5, 8)
    with pytest.raises(SequenceParallelError, match="load_balance cuts each rank's slice into two chunks"):
        hf_ring_attention(None, SequenceAttention(ring=True, balanced=True),  # type: ignore[arg-type]
                          nn.Module(), q, kv, kv, (), {})


def test_the_adapter_refuses_a_length_head_tail_sharding_does_not_cut() -> None:
    from zeroshard.sequence.loader import _check

    batch = {k: {"shape": [2, 12], "dtype": "torch.int64"} for k in ("input_ids", "labels", "position_ids")}
    _check([batch] * 4, 4, False)
    _check([batch] * 3, 3, True)
    with pytest.raises(SequenceParallelError, match="does not split into the 8 chunks of sequence_parallel.load_balance"
                                                     ": pad the batches to a multiple of 8"):
        _check([batch] * 4, 4, True)
