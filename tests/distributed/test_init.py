"""zeroshard.Init: models built already sharded, with the values of a plain construction, in ~1/N memory.

One world runs the cases that train or refuse in turn (``run_family``), each from the same seed,
with engines it closes; the test then checks every case, and a failure names the case: its check,
stage, world size, precision and arguments.  The memory of a build is measured in fresh processes.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn
from zs_common import TINY, make_model

import zeroshard
from zeroshard.host.process_memory import host_peak_bytes
from zeroshard.tools.demo.model import GPT
from zeroshard.tools.testing import Case, CaseFailures, check_family, run_family, run_world

LAYERS, WIDTH = 16, 1024  # 16 x 4 MiB of fp32 weights: 64 MiB in all, 4 MiB in the largest layer


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def peak_rss_bytes() -> int:
    """This process's own RSS high-water mark (VmHWM).  Not ru_maxrss: Linux carries that over exec()
    from the forked parent (here: pytest, whose size depends on what the suite imported before)."""
    return host_peak_bytes()


def build_worker(rank: int, world: int, use_init: bool) -> dict:
    torch.manual_seed(0)
    before = rss_bytes()
    if use_init:
        with zeroshard.Init():
            model = Tower()
    else:
        model = Tower()
    growth = peak_rss_bytes() - before
    held = sum(p._zeroshard_shard.numel() * 4 for p in model.parameters()) if use_init else 0
    return {"growth": growth, "held": held}


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_building_under_init_takes_about_one_nth_of_the_memory() -> None:
    """A plain build (one process), then a build under Init on 4 ranks.

    [Note: a build's memory is measured in a fresh process]
    The peak is the process's high-water mark since it started, and the MALLOC_* thresholds are read
    when it starts: each build has a world of its own."""
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    full = LAYERS * WIDTH * WIDTH * 4
    failures = CaseFailures()
    plain = run_world(build_worker, 1, args=(False,), env=env)[0]
    with failures.case(check="plain_build", stage=3, world=1, precision="fp32"):
        assert plain["growth"] >= 0.9 * full
    for world in (4,):  # 1/N at N = 4 tells a sharded build from a half-sharded one
        results = run_world(build_worker, world, args=(True,), env=env)
        with failures.case(check="build_under_init", stage=3, world=world, precision="fp32"):
            for r in results:
                assert r["held"] == full // world
                # the shards, plus about the largest layer (and its temporary while being initialised)
                assert r["growth"] <= full / world + 3 * WIDTH * WIDTH * 4, (r, full)
    failures.raise_any()


def values_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    with zeroshard.Init():
        model = make_model()  # GPT: tied embedding, a frozen layer, re-initialised by apply() at the end
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20}})
    got = engine.full_state_dict(rank0_only=False)
    expected = make_model().state_dict()
    same = all(torch.equal(got[k], v) for k, v in expected.items()) and list(got) == list(expected)
    x = torch.randint(0, TINY.vocab_size, (1, TINY.seq_len))
    engine.backward(engine(x, x))
    engine.step()
    out = {"same": same, "tied": model.head.weight is model.tok.weight}
    engine.close()
    return out


def check_init_gives_the_values_of_a_plain_construction_and_trains(results: list[dict]) -> None:
    for r in results:
        assert r["same"] and r["tied"]


def wrong_stage_worker(rank: int, world: int) -> str:
    with zeroshard.Init():
        model = GPT(TINY)
    try:
        zeroshard.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD"},
                                                  "zero_optimization": {"stage": 2}})
    except ValueError as err:
        return str(err)
    return "no error"


def check_init_needs_stage_3(results: list[str]) -> None:
    assert "needs ZeRO stage 3" in results[0]


def disabled_worker(rank: int, world: int, api: str) -> dict:
    """Build under a disabled Init (zeroshard's, or DeepSpeed's spelling with a dtype that a disabled
    block must ignore), then train at stage 2, which refuses a model built sharded."""
    init = zeroshard.Init(enabled=False) if api == "zeroshard" else \
        zeroshard.zero.Init(enabled=False, dtype=torch.bfloat16, remote_device="cpu")
    with init:
        model = make_model()
    plain = make_model()
    params = list(model.parameters())
    out = {
        "plain_parameters": all(type(p) is nn.Parameter for p in params),
        "fp32_and_whole": all(p.dtype == torch.float32 and p.untyped_storage().nbytes() == 4 * p.numel()
                              for p in params),
        "same_values": list(model.state_dict()) == list(plain.state_dict())
        and all(torch.equal(v, plain.state_dict()[k]) for k, v in model.state_dict().items()),
        "tied": model.head.weight is model.tok.weight,
    }
    if not all(out.values()):
        return out  # the assertion shows what differs
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2}})
    x = torch.randint(0, TINY.vocab_size, (1, TINY.seq_len))
    engine.backward(engine(x, x))
    engine.step()
    out["trained"] = not torch.equal(model.blocks[1].qkv.weight, plain.blocks[1].qkv.weight)
    engine.close()
    return out


def check_disabled_init_builds_an_ordinary_model(results: list[dict], api: str) -> None:
    """Init(enabled=False) is a no-op: ordinary fp32 nn.Parameters holding all their values, exactly a
    plain construction's, which stage 2 accepts (a model built by an enabled Init it refuses, above)."""
    for r in results:
        assert r == {"plain_parameters": True, "fp32_and_whole": True, "same_values": True, "tied": True,
                     "trained": True}


VALUES = "init_gives_the_values_of_a_plain_construction_and_trains"
DISABLED = "disabled_init_builds_an_ordinary_model"
WRONG_STAGE = "init_needs_stage_3"
#: each case's worker, and the check of its results (one per rank) in the test
WORKERS: dict[str, Callable[..., Any]] = {VALUES: values_worker, DISABLED: disabled_worker,
                                          WRONG_STAGE: wrong_stage_worker}
CHECKS: dict[str, Callable[..., None]] = {
    VALUES: check_init_gives_the_values_of_a_plain_construction_and_trains,
    DISABLED: check_disabled_init_builds_an_ordinary_model,
    WRONG_STAGE: check_init_needs_stage_3,
}
#: the stage each check trains at (or, for the refusal, asks for)
STAGES = {VALUES: 3, DISABLED: 2, WRONG_STAGE: 2}
#: world 3 (padding); the refusal last, as it leaves a model built under Init that no engine took
CASES: list[Case] = [(VALUES, {}), (DISABLED, {"api": "zeroshard"}), (DISABLED, {"api": "deepspeed"}),
                     (WRONG_STAGE, {})]


def labels(name: str, world: int, arguments: dict[str, Any]) -> dict[str, Any]:
    """How a case is named in failures: its check, stage, world size, precision and arguments."""
    return {"check": name, "stage": STAGES[name], "world": world, "precision": "fp32", **arguments}


def test_init_cases() -> None:
    """In a world of 3: Init gives the values of a plain construction and trains; a disabled Init
    (zeroshard's and DeepSpeed's spelling) builds an ordinary model; Init needs stage 3."""
    world = 3
    check_family(CASES, run_family(world, CASES, WORKERS, labels=labels), CHECKS, world, labels=labels)
