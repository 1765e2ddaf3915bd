"""ZeRO++'s quantised communication without a world: the config's keys and refusals, how a shard group
is cut into nodes for qgZ's two hops, the scale model's quantised bytes, and what becomes of an inf or a
NaN in a block (an fp16 overflow must reach the gradient norm through the hops)."""

from __future__ import annotations

import pytest
import torch

from zeroshard.config import ConfigError, load_config
from zeroshard.distributed.topology import Topology, node_partitions
from zeroshard.planning.quantised_traffic import Quantisation
from zeroshard.planning.scale_model import traffic_per_step
from zeroshard.quantize import BlockFormat, pack, packed_bytes, unpack


def zero(**keys: object) -> dict:
    return {"train_batch_size": 4, "zero_optimization": keys}


def test_the_keys_are_read_with_deepspeeds_names() -> None:
    parsed = load_config(zero(stage=3, zero_quantized_weights=True, zero_quantized_gradients=True,
                              zero_quantized_nontrainable_weights=True)).zero_optimization
    assert parsed.zero_quantized_weights and parsed.zero_quantized_gradients
    assert (parsed.zero_quantized_gradients_bits, parsed.zero_quantized_block_size) == (4, 4096)
    # DeepSpeed's defaults (false) are accepted at every stage
    load_config(zero(stage=0, zero_quantized_weights=False, zero_quantized_gradients=False,
                     zero_quantized_nontrainable_weights=False))
    assert Quantisation.from_zero_config(parsed) == Quantisation(True, 4, 4096)


@pytest.mark.parametrize("raw,words", [
    (zero(stage=3, zero_quantized_block_size=0), "zero_optimization.zero_quantized_block_size"),
    (zero(stage=3, zero_quantized_gradients=True, zero_quantized_gradients_bits=3),
     "zero_optimization.zero_quantized_gradients_bits"),
    (zero(stage=2, zero_quantized_weights=True), "'zero_optimization.zero_quantized_weights' needs ZeRO stage 3"),
    (zero(stage=1, zero_quantized_nontrainable_weights=True),
     "'zero_optimization.zero_quantized_nontrainable_weights' needs ZeRO stage 3"),
    (zero(stage=0, zero_quantized_gradients=True),
     "'zero_optimization.zero_quantized_gradients' needs ZeRO stage 1, 2 or 3"),
    (zero(stage=2, zero_quantized_gradients=True, reduce_scatter=False), "'zero_optimization.reduce_scatter'"),
    (zero(stage=2, zero_quantized_gradients=True, mics_shard_size=2), "'zero_optimization.mics_shard_size'"),
    ({**zero(stage=3, zero_quantized_weights=True), "bf16": {"enabled": True}, "fp8": {"enabled": True}},
     "'fp8.gather_weights_in_fp8'"),
])
def test_bad_values_and_combinations_are_named(raw: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=".*") as caught:
        load_config(raw)
    assert words in str(caught.value)


def test_a_shard_group_is_cut_into_nodes() -> None:
    two_by_two = Topology(("a", "a", "b", "b"))
    assert node_partitions([[0, 1, 2, 3]], two_by_two) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    one_node = Topology(("a", "a", "a"))
    assert node_partitions([[0, 1, 2]], one_node) == ([[0, 1, 2]], [])
    uneven = Topology(("a", "a", "b"))  # nodes of unequal sizes: one hop over the whole group
    assert node_partitions([[0, 1, 2]], uneven) == ([[0, 1, 2]], [])
    one_per_node = Topology(("a", "b", "c"))
    assert node_partitions([[0, 1, 2]], one_per_node) == ([[0], [1], [2]], [[0, 1, 2]])


@pytest.mark.parametrize("stage_nodes,expected", [
    # pipeline 3 x data 2 on two nodes of three: stage 1's pair spans the nodes, the others' do not
    ([("a", "a"), ("a", "b"), ("b", "b")], ([[0, 1]], [])),
    # every stage's pair across two nodes: each cut alike, so two groups (only the hop across runs)
    ([("a", "b"), ("c", "d")], ([[0], [1]], [[0, 1]])),
])
def test_pipeline_stages_agree_on_one_cut_into_nodes(monkeypatch: pytest.MonkeyPatch, stage_nodes: list,
                                                     expected: tuple) -> None:
    """Each stage's qgZ groups are created by every rank of the job with the same positions, so every stage
    must take the same cut: where the stages' own cuts differ, every stage reduces in one hop."""
    from types import SimpleNamespace

    from zeroshard.distributed import topology

    parts = tuple((2 * i, 2 * i + 1) for i in range(len(stage_nodes)))
    cuts = [node_partitions([[0, 1]], Topology(nodes)) for nodes in stage_nodes for _ in range(2)]
    monkeypatch.setattr(topology.dist, "get_world_size", lambda: len(cuts))
    monkeypatch.setattr(topology.dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None), cuts))
    comm = SimpleNamespace(world=SimpleNamespace(parts=parts))
    for nodes in stage_nodes:  # every stage, whatever its own nodes, ends with the same cut
        assert topology._agreed_node_partitions(comm, [[0, 1]], Topology(nodes)) == expected


def test_the_scale_model_counts_the_quantised_bytes() -> None:
    """Stage 3 on 2 nodes of 8 (bf16): qwZ's gathers move int8 + scales, about half of bf16's; qgZ's hop
    across nodes moves one 4-bit chunk (+ scales) where the ring moves fifteen of bf16."""
    world, per_node, shard = 16, 8, 40_000
    padded = world * shard
    plain = {c.name: c for c in traffic_per_step(3, padded, world, per_node, 1, 2, 2).by_collective}
    quant = Quantisation(weights=True, gradient_bits=4, block=4096)
    both = {c.name: c for c in traffic_per_step(3, padded, world, per_node, 1, 2, 2, quantisation=quant).by_collective}
    gather = both["param_gather_forward"].bytes_sent
    assert gather == (world - 1) * packed_bytes(shard, BlockFormat(8, 4096))
    assert 0.5 < gather / plain["param_gather_forward"].bytes_sent < 0.501
    assert "grad_reduce_scatter" not in both
    assert both["grad_qgz_inside"].bytes_sent == 7 * packed_bytes(2 * shard, BlockFormat(4, 4096))
    assert not both["grad_qgz_inside"].crosses_nodes and both["grad_qgz_across"].crosses_nodes
    across = both["grad_qgz_across"].bytes_sent
    assert across == packed_bytes(shard, BlockFormat(4, 4096))
    # per element: a quarter of bf16's bytes (and the ring sends 15 chunks where qgZ's hop sends one)
    assert 0.25 < across / (shard * 2) < 0.251
    assert plain["grad_reduce_scatter"].bytes_sent == 15 * shard * 2
    # with hpZ only the first forward's gather (over every rank) is quantised
    hpz = {c.name: c for c in traffic_per_step(3, padded, world, per_node, 2, 2, 2, hpz_partition_size=8,
                                               quantisation=quant).by_collective}
    assert hpz["param_gather_first_forward"].bytes_sent == gather
    assert hpz["param_gather_backward_hpz"].bytes_sent == 2 * 7 * shard * 2 * 2


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_non_finite_value_leaves_its_block_non_finite(bad: float, bits: int) -> None:
    """Its block's scale is inf or NaN, so the whole block dequantises to non-finite values (an overflow is
    then seen by the step's norm, which skips the step); the other blocks come back finite."""
    fmt = BlockFormat(bits, 4)
    values = torch.linspace(-1, 1, 10)
    values[5] = bad
    back = unpack(pack(values, fmt), 10, fmt)
    assert not torch.isfinite(back[4:8]).any() and torch.isfinite(back[:4]).all() and torch.isfinite(back[8:]).all()
