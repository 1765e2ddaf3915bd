"""ZeRO++'s quantised communication on four ranks that zeroshard is told are two nodes of two: qwZ
(``zero_quantized_weights``: stage 3's gathers for compute move int8 blocks and their scales) alone,
with hpZ, for frozen parameters only (``zero_quantized_nontrainable_weights``), a checkpoint saved with
it loaded without it, and the refusals of what it does not serve; qgZ (``zero_quantized_gradients``) at
stages 1-3; and fp16 with both, where one rank's gradients overflow: every rank's reduced chunks are
non-finite (the inf reaches the other ranks' chunks through the quantised hops), every rank skips that
step with its masters untouched, the loss scale halves, and training goes on with finite weights.

Each training case runs the same job twice, without and with quantisation, from the same seed: the
gathers must be the same calls in the same order, each quantised one moving exactly ``payload +
scales`` bytes per rank (never the parameters' own bytes), the loss must fall and stay close to the
unquantised run's.  The cases on four ranks join test_hybrid.py's worlds of two nodes of two (one launch
each for the default and the extended cases, ``run_family``); this file launches only the world of three.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from zs_common import make_model, rank_micro_batches, zero_config

import zeroshard
from zeroshard.distributed.collectives import CallRecord, CommKind, CommScope
from zeroshard.planning.quantised_traffic import Quantisation
from zeroshard.planning.scale_model import traffic_per_step
from zeroshard.quantize import BlockFormat, packed_bytes
from zeroshard.tools.testing import Case, check_family, run_family

WORLD, PER_NODE, STEPS, MICRO, ACCUM, BLOCK = 4, 2, 3, 2, 2, 64
BF16 = 2


def config(quantised: Optional[str], hybrid: bool = False, stage: int = 3, **zero: Any) -> dict:
    out = zero_config(stage, MICRO, ACCUM, stage3_param_persistence_threshold=20, **zero)
    out["optimizer"]["params"]["lr"] = 3e-2
    out["gradient_clipping"] = 1.0
    out["bf16"] = {"enabled": True}
    if hybrid:
        out["zero_optimization"]["zero_hpz_partition_size"] = PER_NODE
    if quantised is not None:
        key = {"all": "zero_quantized_weights", "frozen": "zero_quantized_nontrainable_weights"}[quantised]
        out["zero_optimization"].update({key: True, "zero_quantized_block_size": BLOCK})
    return out


def train(engine: Any, steps: int) -> list[float]:
    """``steps`` optimizer steps on one fixed batch (the loss must fall); every micro step's loss."""
    losses = []
    for _ in range(steps):
        for x, y in rank_micro_batches(0, engine.world.rank, engine.world.world_size, MICRO, ACCUM):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def run(quantised: Optional[str], hybrid: bool, stage: int = 3, **zero: Any) -> dict:
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=config(quantised, hybrid, stage, **zero))
    log = engine.comm.ledger.start_log()
    losses = train(engine, STEPS)
    out = {"log": list(log), "losses": losses, "by_scope": engine.comm.bytes_sent_by_scope(), "state": engine.full_state_dict(),
           "memory": engine.memory_breakdown(),
           "frozen": {b.index for b in engine.storage.layout.buckets if b.frozen},
           "shards": {b.index: b.shard_numel for b in engine.strategy.layout.buckets}}
    engine.close()
    return out


def quantised_and_plain(rank: int, world: int, directory: str, quantised: str, hybrid: bool,
                        qgz: bool = False, offload: bool = False) -> dict:
    """``qgz``: the quantised run reduces its gradients with qgZ too (hpZ + qwZ + qgZ: all of ZeRO++);
    ``offload``: both runs keep the parameters' shards and the optimizer in host memory (``offload_param``,
    which needs ``offload_optimizer``)."""
    place = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}} if offload else {}
    return {"quantised": run(quantised, hybrid, 3, **(qgz_keys(4) if qgz else {}), **place),
            "plain": run(None, hybrid, 3, **place)}


def qgz_keys(bits: int) -> dict:
    return {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": bits, "zero_quantized_block_size": BLOCK}


def gradients_quantised_and_plain(rank: int, world: int, directory: str, stage: int, bits: int) -> dict:
    return {"quantised": run(None, False, stage, **qgz_keys(bits)), "plain": run(None, False, stage)}


def each_and_plain(rank: int, world: int, directory: str) -> dict:
    """Stage 3 three times: without quantisation, with qwZ, with qgZ (4 bits)."""
    return {"plain": run(None, False), "qwz": run("all", False), "qgz": run(None, False, 3, **qgz_keys(4))}


def check_qwz_and_qgz_each_against_the_same_plain_run(results: list[dict], directory: Path) -> None:
    check_qwz_gathers_move_int8_blocks_and_train_as_unquantised(
        [{"quantised": r["qwz"], "plain": r["plain"]} for r in results], directory, "all", False)
    check_qgz_reduces_in_two_quantised_hops_and_trains_as_unquantised(
        [{"quantised": r["qgz"], "plain": r["plain"]} for r in results], directory, 3, 4)


def check_qgz_reduces_in_two_quantised_hops_and_trains_as_unquantised(results: list[dict], directory: Path,
                                                                     stage: int, bits: int) -> None:
    """Every gradient bucket's reduce-scatter becomes one all-to-all inside the node and one across, each
    moving ``bits``-bit blocks and their scales: (L-1) pieces of M chunks inside, (M-1) chunks across."""
    world = len(results)
    nodes = WORLD // PER_NODE if world == WORLD else 1  # the world of 3 is one node
    fmt, local = BlockFormat(bits, BLOCK), world // nodes
    for result in results:
        q, p = result["quantised"], result["plain"]
        plain = [r for r in p["log"] if r.kind is CommKind.REDUCE_SCATTER and r.label.startswith("grad_bucket")]
        hops = [r for r in q["log"] if r.kind is CommKind.ALL_TO_ALL]
        assert plain and not [r for r in q["log"] if r.kind is CommKind.REDUCE_SCATTER]
        hops_per_bucket = 2 if nodes > 1 else 1  # within one node the first hop is the whole reduction
        assert len(hops) == hops_per_bucket * len(plain)  # the same reductions
        moved = plain_moved = 0
        for i, pr in enumerate(plain):
            shard = q["shards"][int(pr.label.removeprefix("grad_bucket"))]
            inside = hops[hops_per_bucket * i]
            assert inside.label == pr.label + ".qgz" and inside.scope is CommScope.INSIDE_NODE
            assert inside.sent == (local - 1) * packed_bytes(nodes * shard, fmt)
            model = predicted(stage, shard * world, world, local, Quantisation(gradient_bits=bits, block=BLOCK))
            assert model["grad_qgz_inside"] == inside.sent  # zeroshard estimate's bytes, exactly
            if nodes == 1:
                moved, plain_moved = moved + inside.sent, plain_moved + pr.sent
                continue
            outside = hops[2 * i + 1]
            assert outside.label == pr.label + ".qgz" and outside.scope is CommScope.ACROSS_NODES
            assert outside.sent == (nodes - 1) * packed_bytes(shard, fmt) == model["grad_qgz_across"]
            moved, plain_moved = moved + outside.sent, plain_moved + pr.sent
        # across nodes: (M-1) S elements at bits/8 bytes (+ scales) against the ring's (N-1) S of bf16's;
        # on one node, (L-1) S elements against the same ring's
        assert moved < plain_moved * bits / 16 * max(nodes - 1, local - 1) / (world - 1) * 1.2
        scope = "across_nodes" if nodes > 1 else "inside_node"
        assert q["by_scope"][scope] - p["by_scope"][scope] == moved - plain_moved
        assert_falls(q["losses"])
        assert_falls(p["losses"])
        assert abs(q["losses"][-1] - p["losses"][-1]) <= 0.03 * p["losses"][-1]
        assert q["memory"]["qgz_buffers"] > 0 and "qgz_buffers" not in p["memory"]
        # the trained weights: finite, and their distance from the unquantised run's a fraction of how far
        # training moved them (Adam moves an element by about lr whatever its gradient's size)
        start = make_model().state_dict()
        names = [n for n in q["state"] if n in start]
        off = sum(float((q["state"][n].float() - p["state"][n].float()).pow(2).sum()) for n in names)
        moved = sum(float((p["state"][n].float() - start[n].float()).pow(2).sum()) for n in names)
        assert all(torch.isfinite(q["state"][n]).all() for n in names)
        assert not names or (off / moved) ** 0.5 < 0.5


def predicted(stage: int, padded: int, world: int, per_node: int, quantisation: Quantisation,
              hpz: Optional[int] = None) -> dict[str, int]:
    """What ``zeroshard estimate``'s scale model says one call of each collective of a bucket of ``padded``
    elements sends (bf16 gathers and reductions)."""
    traffic = traffic_per_step(stage, padded, world, per_node, 1, BF16, BF16, hpz_partition_size=hpz,
                               quantisation=quantisation)
    return {c.name: c.bytes_sent // c.calls for c in traffic.by_collective}


def assert_falls(losses: list[float]) -> None:
    """Each step's first micro batch (the same batch every step) has a lower loss than the step before."""
    firsts = losses[::ACCUM]
    assert all(b < a for a, b in zip(firsts, firsts[1:])) and firsts[-1] < 0.99 * firsts[0], firsts


def compute_gathers(log: list[CallRecord]) -> list[CallRecord]:
    """The gathers of units for forward and backward (not the persistent buckets' after the step)."""
    return [r for r in log if r.kind is CommKind.ALL_GATHER and not r.label.startswith("param_bucket")]


def check_qwz_gathers_move_int8_blocks_and_train_as_unquantised(results: list[dict], directory: Path,
                                                               quantised: str, hybrid: bool, qgz: bool = False,
                                                               offload: bool = False) -> None:
    fmt, world = BlockFormat(8, BLOCK), len(results)
    for result in results:
        q, p = result["quantised"], result["plain"]
        q_gathers, p_gathers = compute_gathers(q["log"]), compute_gathers(p["log"])
        assert len(q_gathers) == len(p_gathers) > 0  # the same gathers, in the same order
        moved = plain_moved = 0
        for qr, pr in zip(q_gathers, p_gathers):
            if pr.group_size != world:  # hpZ's later gathers, inside the node: the dequantised values as they are
                assert hybrid and qr == pr and pr.label.endswith(".hpz") and pr.scope is CommScope.INSIDE_NODE
                continue
            assert pr.full_bytes % (world * BF16) == 0
            shard = pr.full_bytes // (world * BF16)
            if qr.label == pr.label:  # not quantised: only trainable buckets with the frozen-only key
                assert quantised == "frozen" and qr == pr
                continue
            # quantised: int8 payload + fp32 scales per block of each rank's chunk, never bf16's bytes
            assert qr.label == pr.label + ".qwz" and qr.scope is pr.scope
            assert qr.scope is (CommScope.ACROSS_NODES if world == WORLD else CommScope.INSIDE_NODE)
            assert qr.full_bytes == world * packed_bytes(shard, fmt) < pr.full_bytes
            assert qr.sent == (world - 1) * packed_bytes(shard, fmt)
            model = predicted(3, shard * world, world, PER_NODE if world == WORLD else world,
                              Quantisation(weights=True, block=BLOCK), PER_NODE if hybrid else None)
            assert qr.sent == model["param_gather_first_forward" if hybrid else "param_gather_forward"]
            moved, plain_moved = moved + qr.sent, plain_moved + pr.sent
        assert moved > 0
        if quantised == "all":  # a little over half of bf16's bytes: the scales, one per 64 elements
            assert 0.5 < moved / plain_moved < 0.5 + 4 / (2 * BLOCK) + 0.05
        # masters and training: the loss falls, close to the unquantised run's; finite weights
        assert_falls(q["losses"])
        assert_falls(p["losses"])
        assert abs(q["losses"][-1] - p["losses"][-1]) <= (0.03 if qgz else 0.02) * p["losses"][-1]
        for name, value in q["state"].items():
            assert torch.isfinite(value).all(), name
        assert q["memory"]["qwz_gather_buffers"] > 0 and "qwz_gather_buffers" not in p["memory"]
        if offload:  # the parameters' shards live in host memory
            assert q["memory"]["on_host"] == p["memory"]["on_host"] > q["memory"]["params"] > 0


def resume_without(rank: int, world: int, directory: str) -> dict:
    """Two steps with qwZ, a save; a job without it loads the save: the same masters, bit for bit."""
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=config("all"))
    train(engine, 2)
    engine.save_checkpoint(directory, tag="qwz")
    masters, state = engine.strategy.masters.data.clone(), engine.full_state_dict(rank0_only=False)
    asked = engine.zero_quantized_weights() and not engine.zero_quantized_gradients()  # DeepSpeed's accessors
    engine.close()
    plain, _, _, _ = zeroshard.initialize(model=make_model(seed=3), config=config(None))
    plain.load_checkpoint(directory, tag="qwz")
    out = {"equal": torch.equal(masters, plain.strategy.masters.data),
           "accessors": asked and not plain.zero_quantized_weights(),
           "state": all(torch.equal(v, plain.full_state_dict(rank0_only=False)[k]) for k, v in state.items())}
    plain.close()
    return out


def check_a_save_with_qwz_loads_without_it(results: list[dict], directory: Path) -> None:
    assert all(r["equal"] and r["state"] and r["accessors"] for r in results)


#: the step of ``fp16_overflow`` at which rank 1's gradients overflow
POISONED = 1


def fp16_overflow(rank: int, world: int, directory: str) -> dict:
    """fp16 with qwZ and 4-bit qgZ at stage 3; at step ``POISONED`` rank 1's loss is finite but every gradient
    it computes overflows fp16.  Every other rank owns chunks that only the quantised hops bring it the inf
    in (a block whose amax is inf or NaN has a non-finite scale, and dequantises to NaN)."""
    cfg = config("all", False, 3, **qgz_keys(4))
    del cfg["bf16"]
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=cfg)
    out: dict[str, Any] = {"firsts": [], "scales": []}
    for step in range(STEPS + 1):
        before = engine.strategy.masters.data.clone()
        for micro, (x, y) in enumerate(rank_micro_batches(0, rank, world, MICRO, ACCUM)):
            loss = engine(x, y)
            if micro == 0:
                out["firsts"].append(float(loss.detach()))
            if step == POISONED and rank == 1 and micro == 0:
                loss = loss.float() * 1e30  # finite in fp32; its gradients overflow fp16
            engine.backward(loss)
            if step == POISONED and micro == ACCUM - 1:  # this rank's reduced chunks, before the step
                out["owned_finite"] = all(bool(torch.isfinite(engine.strategy.owned_grad(b)).all())
                                          for b in engine.strategy.layout.buckets)
            engine.step()
        if step == POISONED:
            out["untouched"] = torch.equal(before, engine.strategy.masters.data)
        out["scales"].append(engine.loss_scaler.scale)
    out["skipped"] = engine.skipped_steps
    out["finite"] = all(bool(torch.isfinite(v).all()) for v in engine.full_state_dict(rank0_only=False).values())
    engine.close()
    return out


def check_fp16_overflow_skips_the_step_through_quantised_hops(results: list[dict], directory: Path) -> None:
    for rank, result in enumerate(results):
        assert result["owned_finite"] is False, f"rank {rank}'s reduced gradients hide the overflow"
        assert result["skipped"] == 1 and result["untouched"] and result["finite"], result
        scales = result["scales"]
        assert scales[POISONED] == scales[POISONED - 1] / 2 and scales[-1] == scales[POISONED], scales
        firsts = result["firsts"]  # the same batch every step: the skipped step leaves the loss as it was
        assert firsts[POISONED + 1] == firsts[POISONED] and firsts[-1] < 0.99 * firsts[0], firsts


def build_with(rank: int, world: int, directory: str, stage: int, zero: dict, words: str) -> str:
    cfg = zero_config(stage, 1, 1, **zero)
    try:
        zeroshard.initialize(model=make_model(), config=cfg)
    except ValueError as err:
        return str(err)
    return "built"


def check_refused_on_every_rank(results: list[str], directory: Path, stage: int, zero: dict, words: str) -> None:
    assert all(words in message for message in results), results


QWZ = "qwz_gathers_move_int8_blocks_and_train_as_unquantised"
QGZ = "qgz_reduces_in_two_quantised_hops_and_trains_as_unquantised"
EACH = "qwz_and_qgz_each_against_the_same_plain_run"
RESUME = "a_save_with_qwz_loads_without_it"
FP16 = "fp16_overflow_skips_the_step_through_quantised_hops"
REFUSED = "refused_on_every_rank"
WORKERS: dict[str, Callable[..., Any]] = {QWZ: quantised_and_plain, RESUME: resume_without, REFUSED: build_with,
                                          QGZ: gradients_quantised_and_plain, EACH: each_and_plain,
                                          FP16: fp16_overflow}
CHECKS: dict[str, Callable[..., None]] = {QWZ: check_qwz_gathers_move_int8_blocks_and_train_as_unquantised,
                                          RESUME: check_a_save_with_qwz_loads_without_it,
                                          REFUSED: check_refused_on_every_rank,
                                          QGZ: check_qgz_reduces_in_two_quantised_hops_and_trains_as_unquantised,
                                          EACH: check_qwz_and_qgz_each_against_the_same_plain_run,
                                          FP16: check_fp16_overflow_skips_the_step_through_quantised_hops}
#: on two nodes of two (run in test_hybrid.py's worlds): qwZ and qgZ at stage 3 and the refusals by default;
#: all of ZeRO++ with hpZ, qwZ for frozen parameters only, qwZ + qgZ with the parameters offloaded to the
#: host, the save, qgZ at stages 1-2 and an fp16 overflow through qwZ and qgZ extended
DEFAULT_CASES: list[Case] = [
    (EACH, {}),
    (REFUSED, {"stage": 2, "zero": {"zero_quantized_weights": True},
               "words": "'zero_optimization.zero_quantized_weights' needs ZeRO stage 3"}),
    (REFUSED, {"stage": 3, "zero": {"zero_quantized_weights": True, "zero_quantized_block_size": 0},
               "words": "zero_quantized_block_size"}),
]
EXTENDED_CASES: list[Case] = [(QWZ, {"quantised": "all", "hybrid": True, "qgz": True}), (QWZ, {"quantised": "frozen", "hybrid": False}),
                              (QWZ, {"quantised": "all", "hybrid": False, "qgz": True, "offload": True}),
                              (RESUME, {}), (QGZ, {"stage": 1, "bits": 4}), (QGZ, {"stage": 2, "bits": 8}),
                              (FP16, {})]


#: one node of three: every chunk and block size odd, qgZ in one hop
ODD_CASES: list[Case] = [(EACH, {})]


def labels(name: str, world: int, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"check": name, "stage": 3, "world": world, "precision": "fp16" if name == FP16 else "bf16", **arguments}


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_zeropp_on_one_node_of_three(tmp_path: Path) -> None:
    """On one node of three (odd sizes, qgZ in one hop): qwZ and qgZ at stage 3.  The cases on two nodes of
    two run in test_hybrid.py's worlds (``DEFAULT_CASES``, ``EXTENDED_CASES``)."""
    odd = run_family(3, ODD_CASES, WORKERS, labels=labels, root=tmp_path)
    check_family(ODD_CASES, odd, CHECKS, 3, labels=labels, root=tmp_path)
