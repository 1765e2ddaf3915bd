"""Activation checkpointing gives the gradients of the plain model, at every stage, in both modes.

fp32 recomputation repeats the same operations on the same values, so parameters after training must
be *bitwise* equal with and without checkpointing.  Covered: stage 3 (units gathered again for
recomputation, prefetch on), a frozen layer inside a checkpointed block (the test GPT's first block),
a weight used twice inside one checkpointed block, gradient accumulation, and the config keys that
act on a CPU run (cpu_checkpointing, synchronize_checkpoint_boundary, profile).  Every stage in both
modes runs in one world, each case with engines of its own, closed before the next; a failure names
stage, mode and model.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
import zeroshard
from torch import nn
from zs_common import make_model, rank_micro_batches, zero_config

from zeroshard.checkpointing import checkpoint, checkpoint_modules
from zeroshard.tools.demo.model import Block
from zeroshard.tools.testing import CaseFailures, case, run_world


class SharedBlock(nn.Module):
    """Uses its one Linear twice: a weight shared inside the checkpointed region."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(torch.tanh(self.lin(self.norm(x))))


class SharedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(61, 16)
        self.blocks = nn.ModuleList(SharedBlock(16) for _ in range(2))
        self.head = nn.Linear(16, 61)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).reshape(-1, 61), targets.reshape(-1))


def train(model: nn.Module, rank: int, world: int, config: dict) -> nn.Module:
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    for step in range(3):
        for x, y in rank_micro_batches(step, rank, world, 1, 2):
            engine.backward(engine(x, y))
            engine.step()
    return engine


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with zeroshard.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


MODELS = (("gpt", make_model, Block), ("shared", SharedNet, SharedBlock))


def parity_config(stage: int) -> dict:
    config = zero_config(stage, 1, 2, stage3_param_persistence_threshold=20)
    config["activation_checkpointing"] = {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": True,
                                          "profile": True}
    config["steps_per_print"] = 3
    return config


def plain_case(rank: int, world: int, stage: int) -> dict[str, dict[str, torch.Tensor]]:
    """Each model trained without checkpointing: the parameters both modes must equal."""
    out = {}
    for name, build, _ in MODELS:
        plain = build()
        plain_engine = train(plain, rank, world, parity_config(stage))
        out[name] = full_params(plain)
        plain_engine.close()
    return out


def parity_case(rank: int, world: int, stage: int, reentrant: bool,
                plain: dict[str, dict[str, torch.Tensor]]) -> dict:
    out = {}
    for name, build, block in MODELS:
        ours = build()
        wrapped = checkpoint_modules(ours, block, use_reentrant=reentrant)
        engine = train(ours, rank, world, parity_config(stage))
        a, b = plain[name], full_params(ours)
        out[name] = {"wrapped": wrapped, "equal": all(torch.equal(a[k], b[k]) for k in a),
                     "metrics": engine.last_metrics}
        engine.close()
    return out


#: (stage, reentrant): every stage in both modes, in one world (extended)
PARITY_CASES = [(stage, reentrant) for stage in (0, 1, 2, 3) for reentrant in (False, True)]


def parity_worker(rank: int, world: int, cases: list[tuple[int, bool]]) -> dict:
    """Every case in turn, each named in anything it raises; the results by case."""
    out: dict = {}
    plain: dict[int, dict] = {}  # the plain runs by stage, shared by both modes
    for stage, reentrant in cases:
        with case(stage=stage, world=world, mode=mode_name(reentrant)):
            if stage not in plain:
                torch.manual_seed(0)
                plain[stage] = plain_case(rank, world, stage)
            torch.manual_seed(0)
            out[(stage, reentrant)] = parity_case(rank, world, stage, reentrant, plain[stage])
    return out


def mode_name(reentrant: bool) -> str:
    return "reentrant" if reentrant else "non_reentrant"


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_checkpointed_gradients_equal_plain_ones() -> None:
    results = run_world(parity_worker, 2, args=(PARITY_CASES,), timeout=600)
    failures = CaseFailures()
    for rank, rank_results in enumerate(results):
        for stage, reentrant in PARITY_CASES:
            for name, r in rank_results[(stage, reentrant)].items():
                with failures.case(stage=stage, world=2, mode=mode_name(reentrant), model=name, rank=rank):
                    assert r["wrapped"] == 2
                    assert r["equal"], "checkpointed training differs"
                    m = r["metrics"]  # profile: 2 blocks x 2 micro steps x 3 steps, each run once and recomputed once
                    assert m["checkpoint_regions"] == 12 and m["checkpoint_recomputations"] == 12
                    assert m["checkpoint_forward_s"] > 0 and m["checkpoint_recompute_s"] > 0
    failures.raise_any()


class InsideAndOutside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(4, 4)
        self.a = nn.Linear(4, 4)  # registered last: its buckets come first and are reduced before the region's backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: self.a(torch.tanh(self.b(t))), x, use_reentrant=True)
        return self.a(h).pow(2).mean()  # ``a`` also outside the region


def reentrant_outside_worker(rank: int, world: int) -> str:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 1, "reduce_bucket_size": 1}}
    engine, _, _, _ = zeroshard.initialize(model=InsideAndOutside(), config=config)
    try:
        engine.backward(engine(torch.randn(2, 4, requires_grad=True)))
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_reentrant_parameter_used_outside_the_region_is_a_clear_error() -> None:
    for message in run_world(reentrant_outside_worker, 2):
        assert "'a.weight' received a second gradient" in message or "'a.bias' received a second gradient" in message
        assert "use_reentrant=False" in message


def test_checkpoint_modules_needs_a_matching_class() -> None:
    with pytest.raises(ValueError, match="found no submodule of type SharedBlock in GPT"):
        checkpoint_modules(make_model(), SharedBlock)
