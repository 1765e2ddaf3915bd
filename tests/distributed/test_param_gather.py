"""Stages 1-2: the post-step parameter all-gather runs on into the next forward (``overlap_param_gather``),
each module waiting only for its own buckets, and everything that reads the parameters otherwise waits
for all of them (see [Note: the parameter gather runs into the next forward])."""

import pytest
import torch
from zs_common import TINY, make_model, zero_config

import zeroshard
from zeroshard.tools.testing import run_world


def make_engine(stage: int, **zero):
    zero = {"reduce_bucket_size": 800, "allgather_bucket_size": 10**9,  # several buckets, all in flight
            "overlap_param_gather": True, **zero}
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=zero_config(stage, 2, 1, **zero))
    return engine


def train_step(engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len), generator=g)
    engine.backward(engine(x, x))
    engine.step()


def forward_worker(rank: int, world: int, stage: int) -> dict:
    engine = make_engine(stage)
    buckets = len(engine.strategy.layout.buckets)
    train_step(engine, 0)
    after_step = engine.strategy.pending_gathers
    seen = []  # gathers still pending as each module with parameters starts its forward
    hooks = [m.register_forward_pre_hook(lambda *_: seen.append(engine.strategy.pending_gathers))
             for m in engine.module.modules() if any(True for _ in m.parameters(recurse=False))]
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    engine(x, x)
    for h in hooks:
        h.remove()
    readers = {}
    for name, read in (("state_dict", lambda: engine.module.state_dict()),
                       ("gathered", lambda: zeroshard.GatheredParameters(list(engine.module.parameters())).__enter__()),
                       ("full_state_dict", lambda: engine.full_state_dict()),
                       ("save", lambda: engine.save_checkpoint(f"/tmp/zs-param-gather-{world}-{stage}", tag="t"))):
        engine.backward(engine(x, x))
        engine.step()
        before = engine.strategy.pending_gathers
        read()
        readers[name] = (before, engine.strategy.pending_gathers)
    return {"buckets": buckets, "after_step": after_step, "seen": seen, "readers": readers}


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("stage, world", [(1, 2), (2, 3)])
def test_each_module_waits_only_for_its_own_buckets(stage: int, world: int) -> None:
    for r in run_world(forward_worker, world, args=(stage,)):
        assert r["buckets"] >= 3 and r["after_step"] == r["buckets"]  # step() returned with all in flight
        seen = r["seen"]
        assert seen == sorted(seen, reverse=True) and seen[-1] == 0
        assert seen[0] >= 1  # the forward began with gathers still in flight: it waited for its own buckets only
        for name, (before, after) in r["readers"].items():
            assert before == r["buckets"] and after == 0, name


def synchronous_worker(rank: int, world: int) -> int:
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=zero_config(2, 2, 1))  # the default
    train_step(engine, 0)
    return engine.strategy.pending_gathers


def test_by_default_step_returns_with_every_parameter_current() -> None:
    assert run_world(synchronous_worker, 2) == [0, 0]


def capped_worker(rank: int, world: int, stage: int) -> dict:
    import zeroshard.sharding.layout as layout

    layout.MIN_CAPPED_BUCKET = 1000  # the tiny model acts as a large one: DeepSpeed's 5e8 exceeds it
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=zero_config(stage, 2, 1, reduce_bucket_size=500_000_000))
    total = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    biggest_param = max(p.numel() for p in engine.module.parameters())
    return {"sizes": [b.numel for b in engine.strategy.layout.buckets], "total": total, "biggest": biggest_param}


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("stage", [0, 2])
def test_a_bucket_holds_at_most_an_eighth_of_the_model(stage: int) -> None:
    r = run_world(capped_worker, 2, args=(stage,))[0]
    cap = -(-r["total"] // 8)
    assert len(r["sizes"]) >= 6 and sum(r["sizes"]) == r["total"]
    assert all(size < cap + r["biggest"] for size in r["sizes"])  # filled to the cap, a parameter never split
