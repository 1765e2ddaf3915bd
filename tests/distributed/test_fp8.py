"""FP8 layers (zeroshard/fp8/) at ZeRO stages 0-3 against one process, in one world of two.

The test GPT (zs_common's: a tied embedding, a frozen layer, clipping active) is converted by the
config's ``fp8`` block and trains 3 steps at every stage, in fp32 and in bf16 with fp32 masters, and with
the rowwise recipe at stages 0 and 3.  The oracle is one process training the same torchao-converted
model on the global batch with AdamW and clipping (fp32 masters beside bf16 parameters for bf16).  FP8
scales are dynamic, taken over the tensors a GEMM sees, so the oracle runs the global batch as the ranks
see it: each rank's rows in a forward and backward of their own (the loss divided by the world size),
the gradients summed; anything else would quantise with other scales and differ by FP8's rounding.

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
from typing import Any

import torch
from zs_common import CLIP, LR, WD, make_model, rank_micro_batches, zero_config

import zeroshard
from zeroshard.deepspeed.utils import safe_get_full_fp32_param
from zeroshard.distributed.collectives import CommKind
from zeroshard.fp8 import convert, fp8_layers
from zeroshard.tools.testing import CaseFailures, case, run_world

STEPS, MICRO = 3, 2
ORACLE_TOL, STAGES_TOL = 1e-5, 2e-6
#: stage 3 gathers the blocks' weights (the norms and biases, 64 elements at most, stay persistent)
PERSISTENCE = {"stage3_param_persistence_threshold": 100}
#: (stage, precision, recipe, gathers) of the default world; gathers: "fp8" or "hp" (stage 3's weight gathers)
CASES = [(0, "fp32", "tensorwise", "fp8"), (3, "fp32", "tensorwise", "fp8")] + \
    [(stage, "bf16", "tensorwise", "fp8") for stage in (0, 1, 2, 3)] + \
    [(3, "bf16", "tensorwise", "hp"), (0, "bf16", "rowwise", "fp8"), (3, "bf16", "rowwise", "fp8")]


def oracle(world: int, precision: str, recipe: str) -> dict[str, torch.Tensor]:
    """One process, the global batch as the ranks see it; its fp32 parameters (masters under bf16)."""
    masters = make_model()
    convert(masters, recipe)
    work = masters if precision == "fp32" else copy.deepcopy(masters).bfloat16()
    pairs = [(m, w) for m, w in zip(masters.parameters(), work.parameters()) if m.requires_grad]
    opt = torch.optim.AdamW([m for m, _ in pairs], lr=LR, weight_decay=WD)
    for step in range(STEPS):
        for rank in range(world):
            (x, y), = rank_micro_batches(step, rank, world, MICRO, 1)
            (work(x, y) / world).backward()
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


def train(rank: int, world: int, stage: int, precision: str, recipe: str, gathers: str) -> dict[str, Any]:
    model = make_model()
    config = {**zero_config(stage, MICRO, 1, **PERSISTENCE),
              "fp8": {"enabled": True, "recipe": recipe, "gather_weights_in_fp8": gathers == "fp8"},
              "bf16": {"enabled": precision == "bf16"}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    log = engine.comm.ledger.start_log()
    for step in range(STEPS):
        (x, y), = rank_micro_batches(step, rank, world, MICRO, 1)
        engine.backward(engine(x, y))
        engine.step()
    gathered = [(r.label, r.full_bytes) for r in log if r.kind is CommKind.ALL_GATHER]
    amax = sum(r.full_bytes for r in log if r.kind is CommKind.ALL_REDUCE and r.label.endswith(".fp8_amax"))
    full = {name: safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()}
    layers = fp8_layers(engine.module)
    engine.close()
    return {"params": {k: v for k, v in full.items() if v is not None}, "layers": layers, "gathered": gathered,
            "amax_bytes": amax}


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() <= b.keys(), sorted(set(a) - set(b))
    return max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() or 1.0)) for k in a)


def fp8_worker(rank: int, world: int) -> dict:
    out: dict[Any, Any] = {}
    for stage, precision, recipe, gathers in CASES:
        with case(stage=stage, precision=precision, recipe=recipe, gathers=gathers, world=world):
            torch.manual_seed(0)
            run = train(rank, world, stage, precision, recipe, gathers)
            run["oracle"] = _relative(run["params"], oracle(world, precision, recipe))
            out[(stage, precision, recipe, gathers)] = run
    return out


def _check_fp8_gathers(fp8: dict, hp: dict) -> None:
    """Every FP8 gather moves half of the same gather's bytes in bf16; training is the same."""
    hp_bytes = dict(hp["gathered"])
    halves = [(label, size, hp_bytes[label[:-len(".fp8")]]) for label, size in fp8["gathered"] if label.endswith(".fp8")]
    assert halves, f"no FP8 gather: {fp8['gathered']}"
    assert all(2 * size == bf16 for _, size, bf16 in halves), halves
    assert 0 < fp8["amax_bytes"] <= 4 * 8 * len(halves), fp8["amax_bytes"]  # one fp32 amax per weight
    assert not any(label.endswith(".fp8") for label, _ in hp["gathered"])
    assert _relative(fp8["params"], hp["params"]) <= STAGES_TOL, "FP8 gathers changed training"


def test_fp8_stages_follow_one_process_and_each_other() -> None:
    world = 2
    results = run_world(fp8_worker, world)
    failures = CaseFailures()
    for stage, precision, recipe, gathers in CASES:
        for rank, by_case in enumerate(results):
            run = by_case[(stage, precision, recipe, gathers)]
            with failures.case(stage=stage, precision=precision, recipe=recipe, gathers=gathers, rank=rank):
                assert len(run["layers"]) == 8, run["layers"]  # every block linear; the head kept
                assert run["oracle"] <= ORACLE_TOL, f"{run['oracle']:.3g} from the oracle"
                first = by_case[(0, precision, recipe, "fp8")]["params"]
                assert _relative(run["params"], first) <= STAGES_TOL, "stages disagree"
        with failures.case(check="fp8 gathers", world=world, rank=rank):
            _check_fp8_gathers(by_case[(3, "bf16", "tensorwise", "fp8")], by_case[(3, "bf16", "tensorwise", "hp")])
    failures.raise_any()
