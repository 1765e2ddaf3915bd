"""zeroshard.Init: models built already sharded, with the values of a plain construction, in ~1/N memory."""

import pytest
import torch
from torch import nn
from zs_common import TINY, make_model

import zeroshard
from zeroshard.engine.metrics import host_peak_bytes
from zeroshard.tools.demo.model import GPT
from zeroshard.tools.testing import run_world

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
@pytest.mark.parametrize("world", [2, 4])
def test_building_under_init_takes_about_one_nth_of_the_memory(world: int) -> None:
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    plain = run_world(build_worker, 1, args=(False,), env=env)[0]
    full = LAYERS * WIDTH * WIDTH * 4
    assert plain["growth"] >= 0.9 * full
    for r in run_world(build_worker, world, args=(True,), env=env):
        assert r["held"] == full // world
        # the shards, plus about the largest layer (and its temporary while being initialised)
        assert r["growth"] <= full / world + 3 * WIDTH * WIDTH * 4, (r, full)


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
    return {"same": same, "tied": model.head.weight is model.tok.weight}


def test_init_gives_the_values_of_a_plain_construction_and_trains() -> None:
    for r in run_world(values_worker, 3):
        assert r["same"] and r["tied"]


def wrong_stage_worker(rank: int, world: int) -> str:
    with zeroshard.Init():
        model = GPT(TINY)
    try:
        zeroshard.initialize(model=model, config={"train_batch_size": 2, "optimizer": {"type": "SGD"},
                                                  "zero_optimization": {"stage": 2}})
    except ValueError as err:
        return str(err)
    return "no error"


def test_init_needs_stage_3() -> None:
    assert "needs ZeRO stage 3" in run_world(wrong_stage_worker, 2)[0]


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
    return out


@pytest.mark.parametrize("api", ["zeroshard", "deepspeed"])
def test_disabled_init_builds_an_ordinary_model(api: str) -> None:
    """Init(enabled=False) is a no-op: ordinary fp32 nn.Parameters holding all their values, exactly a
    plain construction's, which stage 2 accepts (a model built by an enabled Init it refuses, above)."""
    for r in run_world(disabled_worker, 2, args=(api,)):
        assert r == {"plain_parameters": True, "fp32_and_whole": True, "same_values": True, "tied": True,
                     "trained": True}
