"""FP8 layers (zeroshard/fp8/) at ZeRO stages 0-3 against one process, in worlds of two.

The test GPT (zs_common's: a tied embedding, a frozen layer, clipping active) is converted by the
config's ``fp8`` block and trains 3 steps at every stage in bf16 with fp32 masters, at stages 0 and 3
in fp32, and with the rowwise recipe at stages 0 and 3; stage 3 gathers the blocks' weights in FP8 and,
once, in bf16, whose bytes the FP8 gathers halve exactly.  In the same world (fp32, tensorwise): a
pipeline of 2 stages (1F1B at ZeRO 3, GPipe at ZeRO 0) and expert parallelism (an MoE layer with
``ep_size`` 2, at ZeRO 0 and 3) against their own one-process oracles (fp8_composed.py says how those
quantise alike); ``full_state_dict`` while units gathered in FP8 are held gives the exact values; and
fp16, tensor parallelism and a pattern that matches no layer are each refused by name on every rank.
The extended world, at
stage 3: gradient accumulation (fp32), activation checkpointing, CPU offload of optimizer and parameters
and a model built under ``zeroshard.Init`` against the oracle; a checkpoint saved with FP8 loads without
it (stage 2) and, saved there, back with it, whose next step is the first run's to the bit.

The oracle is one process training the same torchao-converted model on the global batch with AdamW and
clipping (fp32 masters beside bf16 parameters for bf16).  FP8 scales are dynamic, taken over the tensors
a GEMM sees, so the oracle runs the global batch as the ranks see it: each rank's rows in a forward and
backward of their own (the loss divided by the world size), the gradients summed; anything else would
quantise with other scales and differ by FP8's rounding.

[Note: the FP8 tolerances]
With the same quantisation everywhere, the runs differ only in the order of fp32 (or bf16) sums: the
gradient reduction across ranks, the bucketed clipping norm.  The parameters (fp32 masters under bf16)
must be within 1e-5 of the oracle's, relative to each tensor's largest element, as fp32 parity
requires, and the stages within 2e-6 of stage 0 (the same quantisation at every stage; what remains
is the fp32 rounding of the masters).  A layer that ran in high precision, or quantised with the
global batch's scales, differs by FP8's rounding (e4m3's 2**-4 relative), far beyond either bound.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from fp8_composed import PIPE_FP8_LAYERS, full_masters, moe_oracle, moe_trained, pipeline_oracle, pipelined
from zs_common import CLIP, LR, WD, make_model, rank_micro_batches, zero_config

import zeroshard
from zeroshard.distributed.collectives import CommKind
from zeroshard.activations.checkpointing import checkpoint_modules
from zeroshard.fp8 import convert, fp8_layers
from zeroshard.tools.demo.model import Block
from zeroshard.tools.testing import CaseFailures, case, run_world

STEPS, MICRO = 3, 2
ORACLE_TOL, STAGES_TOL = 1e-5, 2e-6
#: stage 3 gathers the blocks' weights (the norms and biases, 64 elements at most, stay persistent)
PERSISTENCE = {"stage3_param_persistence_threshold": 100}
#: (stage, precision, recipe, gathers) of the default world; gathers: "fp8" or "hp" (stage 3's weight gathers)
CASES = [(0, "fp32", "tensorwise", "fp8"), (3, "fp32", "tensorwise", "fp8")] + \
    [(stage, "bf16", "tensorwise", "fp8") for stage in (0, 1, 2, 3)] + \
    [(3, "bf16", "tensorwise", "hp"), (0, "bf16", "rowwise", "fp8"), (3, "bf16", "rowwise", "fp8")]


@functools.lru_cache(maxsize=None)
def oracle(world: int, precision: str, recipe: str, accum: int = 1) -> dict[str, torch.Tensor]:
    """One process, the global batch as the ranks see it; its fp32 parameters (masters under bf16); one run
    per set of arguments in a rank (the cases compare with it, none changes it)."""
    masters = make_model()
    convert(masters, recipe)
    work = masters if precision == "fp32" else copy.deepcopy(masters).bfloat16()
    pairs = [(m, w) for m, w in zip(masters.parameters(), work.parameters()) if m.requires_grad]
    opt = torch.optim.AdamW([m for m, _ in pairs], lr=LR, weight_decay=WD)
    for step in range(STEPS):
        for m in range(accum):
            for rank in range(world):
                x, y = rank_micro_batches(step, rank, world, MICRO, accum)[m]
                (work(x, y) / (world * accum)).backward()
        for m, w in pairs:
            m.grad = w.grad.float()
        torch.nn.utils.clip_grad_norm_([m for m, _ in pairs], CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for m, w in pairs:
            w.grad = None
            if w is not m:
                w.data.copy_(m.data)
    return {name: p.detach().clone() for name, p in masters.named_parameters()}


def fp8_config(stage: int, precision: str, recipe: str = "tensorwise", gathers: str = "fp8", accum: int = 1,
               **zero: Any) -> dict[str, Any]:
    return {**zero_config(stage, MICRO, accum, **PERSISTENCE, **zero),
            "fp8": {"enabled": True, "recipe": recipe, "gather_weights_in_fp8": gathers == "fp8"},
            "bf16": {"enabled": precision == "bf16"}}


def run_steps(engine: Any, rank: int, world: int, steps: range, accum: int = 1) -> None:
    for step in steps:
        for x, y in rank_micro_batches(step, rank, world, MICRO, accum):
            engine.backward(engine(x, y))
            engine.step()


def train(rank: int, world: int, stage: int, precision: str, recipe: str, gathers: str) -> dict[str, Any]:
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=fp8_config(stage, precision, recipe, gathers))
    log = engine.comm.ledger.start_log()
    run_steps(engine, rank, world, range(STEPS))
    gathered = [(r.label, r.full_bytes) for r in log if r.kind is CommKind.ALL_GATHER]
    amax = sum(r.full_bytes for r in log if r.kind is CommKind.ALL_REDUCE and r.label.endswith(".fp8_amax"))
    out = {"params": full_masters(engine), "layers": fp8_layers(engine.module), "gathered": gathered,
           "amax_bytes": amax, "fp8_buffers": engine.memory_breakdown().get("fp8_gather_buffers")}
    engine.close()
    return out


def composed(rank: int, world: int, name: str) -> float:
    """Each composition trained against the oracle: how far from it."""
    model, accum, zero, precision = make_model(), 1, {}, "bf16"
    if name == "accumulation":  # in fp32: the oracle does not model how bf16 gradients accumulate
        accum, precision = 2, "fp32"
    elif name == "checkpointing":
        checkpoint_modules(model, Block)
    elif name == "offload":
        zero = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    config = fp8_config(3, precision, accum=accum, **zero)
    if name == "Init":  # built already sharded, then converted by initialize()
        with zeroshard.Init(config=config):
            model = make_model()
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    run_steps(engine, rank, world, range(STEPS), accum)
    params = full_masters(engine)
    engine.close()
    return _relative(params, oracle(world, precision, "tensorwise", accum))


def exact_after_fp8(rank: int, world: int) -> tuple[int, float]:
    """``full_state_dict`` between a forward and its backward, while units the forward gathered in FP8 are
    still gathered: how many were, and how far its values are from the bf16 parameters (exactly 0)."""
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=fp8_config(3, "bf16"))
    run_steps(engine, rank, world, range(1))
    (x, y), = rank_micro_batches(1, rank, world, MICRO, 1)
    loss = engine(x, y)
    held = len(engine.storage._gathered_compressed)
    full = engine.full_state_dict(rank0_only=False)
    masters = full_masters(engine)
    engine.backward(loss)
    engine.step()
    engine.close()
    return held, max(float((full[k].float() - masters[k].bfloat16().float()).abs().max()) for k in masters)


def checkpoints(rank: int, world: int, directory: str) -> dict[str, float]:
    """Saved with FP8 at stage 3, loaded without it at stage 2; saved there, loaded back with FP8: the next
    step is the one the first run took."""
    first, second = Path(directory) / "fp8", Path(directory) / "plain"
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=fp8_config(3, "bf16"))
    run_steps(engine, rank, world, range(STEPS))
    saved = full_masters(engine)
    engine.save_checkpoint(first)
    run_steps(engine, rank, world, range(STEPS, STEPS + 1))
    after = full_masters(engine)
    engine.close()
    plain_config = {**fp8_config(2, "bf16"), "fp8": {"enabled": False}}
    plain, _, _, _ = zeroshard.initialize(model=make_model(), config=plain_config)
    plain.load_checkpoint(first)
    loaded = full_masters(plain)
    plain.save_checkpoint(second)
    plain.close()
    back, _, _, _ = zeroshard.initialize(model=make_model(), config=fp8_config(3, "bf16"))
    back.load_checkpoint(second)
    run_steps(back, rank, world, range(STEPS, STEPS + 1))
    resumed = full_masters(back)
    back.close()
    return {"loaded without FP8": _relative(loaded, saved), "resumed with FP8": _relative(resumed, after)}


def refused(rank: int, world: int) -> dict[str, str]:
    """What FP8 refuses, named on every rank before the first step: the error each rank raised."""
    attempts = {
        "fp16": lambda: zeroshard.initialize(model=make_model(), config={**fp8_config(2, "fp32"),
                                                                         "fp16": {"enabled": True}}),
        "tensor parallelism": lambda: zeroshard.initialize(model=make_model(), config={
            **fp8_config(1, "fp32"), "tensor_parallel": {"autotp_size": 2}}),
        "no match": lambda: zeroshard.initialize(model=make_model(), config={
            **fp8_config(2, "fp32"), "fp8": {"enabled": True, "include": ["layers.*"]}}),
    }
    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "accepted"
        except Exception as error:  # noqa: BLE001 - the test reads which error each rank raised
            out[name] = f"{type(error).__name__}: {error}"
    return out


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() <= b.keys(), sorted(set(a) - set(b))
    return max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() or 1.0)) for k in a)


#: (ZeRO stage, schedule) of the pipeline cases: 2 stages x 1 data-parallel rank, fp32, tensorwise
PIPELINE_CASES = ((3, "1f1b"), (0, "gpipe"))
#: ZeRO stages of the expert-parallel cases (ep 2, fp32, tensorwise; stage 3 gathers the experts in FP8)
EXPERT_STAGES = (0, 3)
#: compositions at stage 3 (tensorwise, FP8 gathers; bf16, accumulation in fp32), each against the oracle
COMPOSITIONS = ("accumulation", "checkpointing", "offload", "Init")
#: the error each refusal must raise on every rank
REFUSALS = {"fp16": "ConfigError: 'fp8.enabled' with 'fp16.enabled'",
            "tensor parallelism": "NotSupportedByZeroshard: 'fp8.enabled' with tensor parallelism",
            "no match": "FP8ConfigError: 'fp8.include' pattern 'layers.*' matches no nn.Linear"}


def fp8_worker(rank: int, world: int) -> dict:
    """The default world: the stages, the refusals, exact gathers after FP8 ones."""
    out: dict[Any, Any] = {}
    for stage, precision, recipe, gathers in CASES:
        with case(stage=stage, precision=precision, recipe=recipe, gathers=gathers, world=world):
            torch.manual_seed(0)
            run = train(rank, world, stage, precision, recipe, gathers)
            run["oracle"] = _relative(run["params"], oracle(world, precision, recipe))
            out[(stage, precision, recipe, gathers)] = run
    for stage, schedule in PIPELINE_CASES:
        with case(pipeline=schedule, stage=stage, world=world):
            run = pipelined(world, {**fp8_config(stage, "fp32"), "pipeline": {"schedule": schedule}}, STEPS)
            run["oracle"] = _relative(run.pop("params"), pipeline_oracle(STEPS))
            out[("pipeline", stage, schedule)] = run
    for stage in EXPERT_STAGES:
        with case(experts=stage, world=world):
            run = moe_trained(rank, world, fp8_config(stage, "fp32"), STEPS)
            run["oracle"] = _relative(run.pop("params"), moe_oracle(world, STEPS))
            out[("experts", stage)] = run
    with case(check="exact after FP8 gathers", world=world):
        out["exact"] = exact_after_fp8(rank, world)
    with case(check="refused", world=world):
        out["refused"] = refused(rank, world)
    return out


def compositions_worker(rank: int, world: int, directory: str) -> dict:
    """The extended world: the compositions and the checkpoints."""
    out: dict[Any, Any] = {}
    for name in COMPOSITIONS:
        with case(composition=name, world=world):
            torch.manual_seed(0)
            out[name] = composed(rank, world, name)
    with case(check="checkpoints", world=world):
        out["checkpoints"] = checkpoints(rank, world, directory)
    return out


def _check_fp8_gathers(fp8: dict, hp: dict) -> None:
    """Every FP8 gather moves half of the same gather's bytes in bf16 (the memory breakdown counts its
    buffers); training is the same."""
    hp_bytes = dict(hp["gathered"])
    halves = [(label, size, hp_bytes[label[:-len(".fp8")]])
              for label, size in fp8["gathered"] if label.endswith(".fp8")]
    assert halves, f"no FP8 gather: {fp8['gathered']}"
    assert all(2 * size == bf16 for _, size, bf16 in halves), halves
    assert 0 < fp8["amax_bytes"] <= 4 * 8 * len(halves), fp8["amax_bytes"]  # one fp32 amax per weight
    assert not any(label.endswith(".fp8") for label, _ in hp["gathered"])
    largest = max(size for _, size, _ in halves)  # the breakdown's transient buffers: its chunks, sent and received
    assert fp8["fp8_buffers"] == largest + largest // 2 and hp["fp8_buffers"] is None, fp8["fp8_buffers"]
    assert _relative(fp8["params"], hp["params"]) <= STAGES_TOL, "FP8 gathers changed training"


@pytest.fixture(scope="module")
def world_2() -> list[dict]:
    return run_world(fp8_worker, 2)


def test_fp8_stages_follow_one_process_and_each_other(world_2: list[dict]) -> None:
    failures = CaseFailures()
    for stage, precision, recipe, gathers in CASES:
        for rank, by_case in enumerate(world_2):
            run = by_case[(stage, precision, recipe, gathers)]
            with failures.case(stage=stage, precision=precision, recipe=recipe, gathers=gathers, rank=rank):
                assert len(run["layers"]) == 8, run["layers"]  # every block linear; the head kept
                assert run["oracle"] <= ORACLE_TOL, f"{run['oracle']:.3g} from the oracle"
                first = by_case[(0, precision, recipe, "fp8")]["params"]
                assert _relative(run["params"], first) <= STAGES_TOL, "stages disagree"
    for rank, by_case in enumerate(world_2):
        with failures.case(check="fp8 gathers", rank=rank):
            _check_fp8_gathers(by_case[(3, "bf16", "tensorwise", "fp8")], by_case[(3, "bf16", "tensorwise", "hp")])
    failures.raise_any()


def test_fp8_pipeline_stages_follow_one_process(world_2: list[dict]) -> None:
    failures = CaseFailures()
    for stage, schedule in PIPELINE_CASES:
        for rank, by_case in enumerate(world_2):
            run = by_case[("pipeline", stage, schedule)]
            with failures.case(pipeline=schedule, stage=stage, rank=rank):
                assert run["layers"] == PIPE_FP8_LAYERS[rank], run["layers"]
                assert run["oracle"] <= ORACLE_TOL, f"{run['oracle']:.3g} from the oracle"
    failures.raise_any()


def test_fp8_experts_follow_one_process(world_2: list[dict]) -> None:
    """Expert parallelism (ep 2): each rank's two experts' linears in FP8, the router and head kept."""
    failures = CaseFailures()
    experts = "moe.deepspeed_moe.experts.deepspeed_experts"
    for stage in EXPERT_STAGES:
        for rank, by_case in enumerate(world_2):
            run = by_case[("experts", stage)]
            with failures.case(experts=stage, rank=rank):
                assert run["layers"] == [f"{experts}.{e}.{i}" for e in (0, 1) for i in (0, 2)], run["layers"]
                assert run["oracle"] <= ORACLE_TOL, f"{run['oracle']:.3g} from the oracle"
    failures.raise_any()


def test_exact_gathers_after_fp8_gathers(world_2: list[dict]) -> None:
    failures = CaseFailures()
    for rank, by_case in enumerate(world_2):
        with failures.case(check="exact after FP8 gathers", rank=rank):
            held, diff = by_case["exact"]
            assert held and diff == 0.0, (held, diff)
    failures.raise_any()


@pytest.mark.slow
def test_fp8_composes_with_accumulation_checkpointing_offload_init_and_checkpoints(tmp_path: Path) -> None:
    failures = CaseFailures()
    for rank, by_case in enumerate(run_world(compositions_worker, 2, args=(str(tmp_path),))):
        for name in COMPOSITIONS:
            with failures.case(composition=name, rank=rank):
                assert by_case[name] <= ORACLE_TOL, f"{by_case[name]:.3g} from the oracle"
        for name, diff in by_case["checkpoints"].items():
            with failures.case(check=name, rank=rank):
                assert diff == 0.0, f"{diff:.3g}"
    failures.raise_any()


def test_what_fp8_cannot_serve_is_refused_by_name_on_every_rank(world_2: list[dict]) -> None:
    failures = CaseFailures()
    for rank, by_case in enumerate(world_2):
        for name, expected in REFUSALS.items():
            with failures.case(refusal=name, rank=rank):
                assert by_case["refused"][name].startswith(expected), by_case["refused"][name]
    failures.raise_any()
