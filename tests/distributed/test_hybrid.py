"""Hybrid sharding (MiCS ``mics_shard_size``, ZeRO++ hpZ ``zero_hpz_partition_size``) on four ranks that
zeroshard is told are two nodes of two (as torchrun tells them): each trains as one process on the
whole global batch, and every collective is where it should be, checked call by call: which group it
ran over, whether its bytes stayed inside a node, and the exact bytes that crossed nodes.

One world of four runs its cases in turn (``run_family``), ZeRO++'s qwZ and qgZ too (test_zeropp.py),
each from the same seed, in a directory of its own, with engines it closes; the test then checks every
case, and a failure names the case: its check, stage, world size, hybrid sharding and arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors import safe_open
from test_zeropp import CHECKS as ZEROPP_CHECKS
from test_zeropp import DEFAULT_CASES as ZEROPP_DEFAULT_CASES
from test_zeropp import EXTENDED_CASES as ZEROPP_EXTENDED_CASES
from test_zeropp import WORKERS as ZEROPP_WORKERS
from test_zeropp import labels as zeropp_labels
from zs_common import make_model, rank_micro_batches, single_process_reference, zero_config

import zeroshard
from zeroshard.checkpoint.consolidate import full_state_dict
from zeroshard.distributed.collectives import CallRecord, CommKind, CommScope
from zeroshard.config import ZeroConfig
from zeroshard.planning import model_state_bytes
from zeroshard.planning.scale_model import traffic_per_step
from zeroshard.tools.testing import Case, case, case_directory, check_family, run_family, run_world

WORLD, PER_NODE, STEPS, MICRO, ACCUM = 4, 2, 3, 2, 2
FP32 = 4
REUSE = ZeroConfig().stage3_max_reuse_distance  # the default: every unit kept from forward to backward
HYBRID = {"mics": {"mics_shard_size": PER_NODE}, "hpz": {"zero_hpz_partition_size": PER_NODE}}

def config(stage: int, hybrid: str | None, **zero: Any) -> dict:
    extra = {"stage3_param_persistence_threshold": 20} if stage == 3 else {}
    return zero_config(stage, MICRO, ACCUM, **extra, **(HYBRID[hybrid] if hybrid else {}), **zero)


def train(engine: Any, first: int, last: int) -> None:
    for step in range(first, last):
        for x, y in rank_micro_batches(step, engine.world.rank, WORLD, MICRO, ACCUM):
            engine.backward(engine(x, y))
            engine.step()


def train_and_log(rank: int, world: int, directory: str, stage: int, hybrid: str) -> dict:
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=config(stage, hybrid))
    log = engine.comm.ledger.start_log()
    step_scopes = []  # the bytes by scope after each step
    for step in range(STEPS):
        train(engine, step, step + 1)
        step_scopes.append(engine.comm.bytes_sent_by_scope())
    layout = engine.strategy.layout  # the trainable buckets; stage 3 also shards the model's frozen layer
    persistent = sorted(engine.strategy.plan.persistent_buckets) if stage == 3 else []
    out = {"log": list(log), "by_scope": engine.comm.bytes_sent_by_scope(), "memory": engine.memory_breakdown(),
           "buckets": [(b.padded_numel, b.shard_numel, b.numel) for b in layout.buckets], "persistent": persistent,
           "frozen": [b.padded_numel for b in engine.storage.layout.buckets if b.frozen],
           "shard_rank": engine.strategy.world.rank, "step_scopes": step_scopes}
    out["state"] = engine.full_state_dict()
    if hybrid == "hpz":  # the same job without hpZ: the same gathers, only from elsewhere
        engine.close()
        plain, _, _, _ = zeroshard.initialize(model=make_model(), config=config(stage, None))
        plain_log = plain.comm.ledger.start_log()
        train(plain, 0, STEPS)
        out["plain_gathers"] = sum(r.kind is CommKind.ALL_GATHER for r in plain_log)
        plain.close()
    else:
        engine.close()
    return out


def across(log: list[CallRecord]) -> int:
    return sum(r.sent for r in log if r.scope is CommScope.ACROSS_NODES)


def predicted(stage: int, result: dict, hybrid: str) -> dict[str, int]:
    """The scale model's bytes per step (``zeroshard estimate``) for this run's padded buckets: stage 3's
    persistent buckets travel as at stage 2 (reduce-scattered each micro step, gathered after the step);
    stage 3 keeps its units gathered from forward to backward (``stage3_max_reuse_distance`` at its
    default)."""
    knobs = {"mics": {"mics_shard_size": PER_NODE}, "hpz": {"hpz_partition_size": PER_NODE}}[hybrid]
    persistent = set(result["persistent"])
    sharded = [b[0] for i, b in enumerate(result["buckets"]) if i not in persistent]
    whole = [b[0] for i, b in enumerate(result["buckets"]) if i in persistent]
    out = {"inside_node": 0, "across_nodes": 0}
    parts = [(stage, sharded)] + ([(2, whole)] if whole else [])
    for part_stage, numels in parts:
        knob = knobs if part_stage == 3 or hybrid == "mics" else {}
        for scope, sent in traffic_per_step(part_stage, numels, WORLD, PER_NODE, ACCUM, FP32, FP32,
                                            max_reuse_distance=REUSE, **knob).by_scope().items():
            out[scope] += sent
    return out


def check_mics_trains_as_one_process_and_only_the_replica_all_reduce_crosses_nodes(
        results: list[dict], directory: Path, stage: int, hybrid: str) -> None:
    """MiCS over groups of 2 (one per node): parameters, gradients and optimizer state sharded inside
    the node, replicated across; once per step each rank all-reduces its gradient shard with the rank
    holding the same shard on the other node, and nothing else crosses."""
    expected = single_process_reference(STEPS, WORLD, MICRO, ACCUM)
    for name, value in expected.items():
        torch.testing.assert_close(results[0]["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    replicas = WORLD // PER_NODE
    for rank, result in enumerate(results):
        assert result["shard_rank"] == rank % PER_NODE
        log: list[CallRecord] = result["log"]
        crossing = [r for r in log if r.scope is CommScope.ACROSS_NODES]
        assert {(r.kind, r.group_size) for r in crossing} == {(CommKind.ALL_REDUCE, replicas)}
        assert all(r.label.startswith("grad_replicas") for r in crossing)
        assert all(r.group_size == PER_NODE for r in log if r.scope is CommScope.INSIDE_NODE)
        # per step and bucket: 2 (R-1)/R of the shard, fp32, across; everything else inside the node
        per_step = sum(2 * (replicas - 1) * shard * FP32 // replicas for _, shard, _ in result["buckets"])
        assert across(log) == result["by_scope"]["across_nodes"] == STEPS * per_step
        assert result["by_scope"]["inside_node"] == sum(r.sent for r in log) - STEPS * per_step > 0
        memory = result["memory"]  # the state is sharded over the 2 ranks of the node, not over 4
        numel = sum(real for _, _, real in result["buckets"])
        assert memory["formula"] == model_state_bytes(stage, numel, PER_NODE, "fp32").total
        assert memory["optimizer"] == 8 * sum(min(max(real - result["shard_rank"] * shard, 0), shard)
                                              for _, shard, real in result["buckets"])
        # zeroshard estimate's scale model predicts the bytes across nodes to the byte
        assert STEPS * predicted(stage, result, "mics")["across_nodes"] == result["by_scope"]["across_nodes"]
    grad_norm = 2 * (PER_NODE - 1) * 8 // PER_NODE  # one float64 all-reduce over the shard group
    if stage < 3:  # inside the node: the reduce-scatters (one per micro step at stage 2) and the gathers
        k = ACCUM if stage == 2 else 1
        inside = sum((k + 1) * (PER_NODE - 1) * padded * FP32 // PER_NODE for padded, _, _ in results[0]["buckets"])
        assert results[0]["by_scope"]["inside_node"] == STEPS * (inside + grad_norm)
        assert predicted(stage, results[0], "mics")["inside_node"] == inside
        return
    # stage 3, once the first pass has recorded the order: each unit gathered for forward and kept for
    # backward; the scale model's bytes inside the node to the byte, plus the frozen layer's gathers
    for result in results:
        last, before = result["step_scopes"][-1], result["step_scopes"][-2]
        frozen = sum(ACCUM * (PER_NODE - 1) * padded * FP32 // PER_NODE for padded in result["frozen"])
        assert (last["inside_node"] - before["inside_node"]
                == predicted(3, result, "mics")["inside_node"] + frozen + grad_norm)


def check_hpz_trains_as_one_process_and_gathers_inside_the_node_after_the_first(
        results: list[dict], directory: Path, stage: int, hybrid: str) -> None:
    """hpZ over groups of 2: the first gather of each bucket after a step comes over all 4 ranks (and
    across nodes); every later one (backward, the second micro step's forward) from the secondary
    partition inside the node.  Gradients still reduce-scatter over all 4 ranks."""
    expected = single_process_reference(STEPS, WORLD, MICRO, ACCUM)
    for name, value in expected.items():
        torch.testing.assert_close(results[0]["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    for result in results:
        log: list[CallRecord] = result["log"]
        buckets, persistent = result["buckets"], set(result["persistent"])
        sharded = [i for i in range(len(buckets)) if i not in persistent]
        frozen = result["frozen"]  # gathered like the others, never reduced
        assert sharded and persistent and frozen
        secondary = [r for r in log if r.label.endswith(".hpz")]
        assert secondary and all(r.kind is CommKind.ALL_GATHER and r.group_size == PER_NODE
                                 and r.scope is CommScope.INSIDE_NODE for r in secondary)
        assert all(r.group_size == WORLD and r.scope is CommScope.ACROSS_NODES
                   for r in log if not r.label.endswith(".hpz"))
        primary_gathers = [r for r in log if r.kind is CommKind.ALL_GATHER and r.group_size == WORLD
                           and not r.label.startswith("param_bucket")]
        assert len(primary_gathers) == STEPS * (len(sharded) + len(frozen))  # one per bucket per step
        # hpZ changes where a gather comes from, never how many there are
        assert len(primary_gathers) + len(secondary) == result["plain_gathers"] - STEPS * len(persistent)

        def ring(padded: int) -> int:
            return (WORLD - 1) * padded * FP32 // WORLD
        per_step = (sum(ring(buckets[i][0]) for i in sharded)  # the first gather of each sharded bucket
                    + sum(ring(padded) for padded in frozen)
                    + ACCUM * sum(ring(padded) for padded, _, _ in buckets)  # reduce-scatter every micro step
                    + sum(ring(buckets[i][0]) for i in persistent)  # persistent buckets after the step
                    + 2 * (WORLD - 1) * 8 // WORLD)  # the gradient norm (float64)
        assert across(log) == result["by_scope"]["across_nodes"] == STEPS * per_step
        # the scale model (trainable buckets), plus the frozen buckets' first gathers
        assert (predicted(3, result, "hpz")["across_nodes"] + sum(ring(padded) for padded in frozen)
                == per_step - 2 * (WORLD - 1) * 8 // WORLD)
        assert result["memory"]["secondary_params"] == sum(
            padded // PER_NODE * FP32 for padded in [buckets[i][0] for i in sharded] + frozen)


def save_resume_modify(rank: int, world: int, directory: str, hybrid: str) -> dict:
    """Train 2 steps, save, train the 3rd; a second engine loads the save and trains the 3rd too; then a
    GatheredParameters change by rank 0 after a forward (hpZ's secondary partition is then current)."""
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=config(3, hybrid))
    train(engine, 0, STEPS - 1)
    engine.save_checkpoint(directory, tag="two")
    train(engine, STEPS - 1, STEPS)
    uninterrupted = engine.full_state_dict(rank0_only=False)
    engine.close()
    resumed, _, _, _ = zeroshard.initialize(model=make_model(seed=5), config=config(3, hybrid))
    resumed.load_checkpoint(directory, tag="two")
    train(resumed, STEPS - 1, STEPS)
    after_resume = resumed.full_state_dict(rank0_only=False)
    x, y = rank_micro_batches(0, rank, WORLD, MICRO, ACCUM)[0]
    resumed(x, y)  # a forward: every sharded bucket gathered, hpZ's secondary partition built
    head = resumed.module.blocks[1].proj.weight
    with zeroshard.GatheredParameters([head], modifier_rank=0):
        if rank == 0:
            head.data.fill_(0.25)
    modified = resumed.full_state_dict(rank0_only=False)["blocks.1.proj.weight"]
    resumed.close()
    return {"uninterrupted": uninterrupted, "resumed": after_resume, "modified": modified}


def check_hybrid_checkpoints_resume_exactly_and_reshard(results: list[dict], directory: Path, hybrid: str,
                                                        loaded: dict[str, torch.Tensor]) -> None:
    """``loaded``: what plain stage 2 on 3 ranks loaded from the save (``load_plain``)."""
    for result in results:
        for name, value in result["uninterrupted"].items():
            assert torch.equal(result["resumed"][name], value), name
        assert torch.equal(result["modified"], torch.full_like(result["modified"], 0.25))  # every rank, every node
    saved = full_state_dict(directory / "two")  # offline consolidation sees the whole model
    files = sorted(p.name for p in (directory / "two").glob("rank*.safetensors"))
    assert files == [f"rank{r:05d}.safetensors" for r in range(WORLD)]
    if hybrid == "mics":  # the first node's ranks hold the shards; the others only their RNG state
        for r in range(WORLD):
            with safe_open(str(directory / "two" / files[r]), "pt") as f:
                assert any(k.startswith("param.") for k in f.keys()) == (r < PER_NODE), files[r]
    # and any other layout loads it: plain stage 2 on 3 ranks
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name


def load_plain(rank: int, world: int, directories: list[str]) -> list[dict]:
    """Each save loaded by plain stage 2 (on a world of 3): rank 0's full state dict of each."""
    states = []
    for directory in directories:
        with case(check="hybrid_checkpoints_resume_exactly_and_reshard", stage=2, world=world, directory=directory):
            engine, _, _, _ = zeroshard.initialize(model=make_model(seed=7), config=zero_config(2, 1, 1))
            engine.load_checkpoint(directory, tag="two")
            states.append(engine.full_state_dict())
            engine.close()
    return states


def build_with(rank: int, world: int, directory: str, stage: int, zero: dict) -> str:
    try:
        zeroshard.initialize(model=make_model(), config=zero_config(stage, 1, 1, **zero))
    except ValueError as err:
        return str(err)
    return "built"


def check_a_group_size_that_does_not_divide_the_world_is_refused_on_every_rank(
        results: list[str], directory: Path, stage: int, zero: dict) -> None:
    key = next(iter(zero))
    for message in results:
        assert f"zero_optimization.{key} = 3 does not divide the world size {WORLD}" in message


MICS = "mics_trains_as_one_process_and_only_the_replica_all_reduce_crosses_nodes"
HPZ = "hpz_trains_as_one_process_and_gathers_inside_the_node_after_the_first"
RESUME = "hybrid_checkpoints_resume_exactly_and_reshard"
REFUSED = "a_group_size_that_does_not_divide_the_world_is_refused_on_every_rank"
#: each case's worker (called with the case's own directory first), and the check of its results (one per rank)
WORKERS: dict[str, Callable[..., Any]] = {MICS: train_and_log, HPZ: train_and_log, RESUME: save_resume_modify,
                                          REFUSED: build_with, **ZEROPP_WORKERS}
CHECKS: dict[str, Callable[..., None]] = {
    MICS: check_mics_trains_as_one_process_and_only_the_replica_all_reduce_crosses_nodes,
    HPZ: check_hpz_trains_as_one_process_and_gathers_inside_the_node_after_the_first,
    RESUME: check_hybrid_checkpoints_resume_exactly_and_reshard,
    REFUSED: check_a_group_size_that_does_not_divide_the_world_is_refused_on_every_rank,
    **ZEROPP_CHECKS,  # ZeRO++'s qwZ and qgZ (test_zeropp.py), on the same two nodes of two
}

#: on two nodes of two (world 4): MiCS at stage 3 and the refusals of a group size of 3 by default, the
#: rest extended
DEFAULT_NODE_CASES: list[Case] = [(MICS, {"stage": 3, "hybrid": "mics"}),
                                  (REFUSED, {"stage": 3, "zero": {"mics_shard_size": 3}}),
                                  (REFUSED, {"stage": 3, "zero": {"zero_hpz_partition_size": 3}}),
                                  *ZEROPP_DEFAULT_CASES]
EXTENDED_NODE_CASES: list[Case] = [(MICS, {"stage": 1, "hybrid": "mics"}), (MICS, {"stage": 2, "hybrid": "mics"}),
                                   (HPZ, {"stage": 3, "hybrid": "hpz"}),
                                   (RESUME, {"hybrid": "mics"}), (RESUME, {"hybrid": "hpz"}), *ZEROPP_EXTENDED_CASES]


def labels(name: str, world: int, arguments: dict[str, Any]) -> dict[str, Any]:
    """How a case is named in failures: its check, stage, world size, precision and other arguments."""
    if name in ZEROPP_CHECKS:
        return zeropp_labels(name, world, arguments)
    rest = {"stage": 3, **arguments}
    return {"check": name, "stage": rest.pop("stage"), "world": world, "precision": "fp32", **rest}


def test_hybrid_cases(tmp_path: Path) -> None:
    """On two nodes of two: MiCS at stage 3; a group size that does not divide the world (3) is refused
    on every rank (MiCS and hpZ); ZeRO++'s qwZ and qgZ at stage 3 and their refusals (test_zeropp.py)."""
    nodes = run_family(WORLD, DEFAULT_NODE_CASES, WORKERS, labels=labels, root=tmp_path, ranks_per_node=PER_NODE)
    check_family(DEFAULT_NODE_CASES, nodes, CHECKS, WORLD, labels=labels, root=tmp_path)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_hybrid_extended_cases(tmp_path: Path) -> None:
    """On two nodes of two: MiCS at stages 1 and 2, hpZ, and checkpoints of both that resume exactly and
    reshard: each save is then loaded by plain stage 2 on 3 ranks; ZeRO++'s extended cases (test_zeropp.py)."""
    nodes = run_family(WORLD, EXTENDED_NODE_CASES, WORKERS, labels=labels, root=tmp_path, ranks_per_node=PER_NODE)
    saves = [index for index, (name, _) in enumerate(EXTENDED_NODE_CASES) if name == RESUME]
    loaded = run_world(load_plain, 3, args=([str(case_directory(tmp_path, i)) for i in saves],), timeout=600)[0]
    check_family(EXTENDED_NODE_CASES, nodes, CHECKS, WORLD, labels=labels, root=tmp_path,
                 more={index: {"loaded": state} for index, state in zip(saves, loaded)})
