"""Whole-matrix optimizers in one process: who owns each matrix, which parts travel, and a world of one
stepping Muon (torch's own bf16 Newton-Schulz) and Adafactor bitwise as plain PyTorch does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.distributed.collectives import Collectives
from zeroshard.distributed.world import World
from zeroshard.optim.muon import MuonWithAuxAdam, NoMatrixError, UseMuonMarkError, split_for_muon
from zeroshard.optim.param_groups import collect_trainable
from zeroshard.optim.whole_matrices import BucketPlan, WholeMatrixError, assign_owners
from zeroshard.sharding.layout import LayoutBuilder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from test_muon import MATRICES, PARAMS, Tiny, batch, oracle, use_newton_schulz  # noqa: E402


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


def test_owners_balance_elements_largest_first() -> None:
    owners = assign_owners({0: 100, 1: 60, 2: 50, 3: 10}, 2)
    assert owners == {0: 0, 1: 1, 2: 1, 3: 0}  # loads 110 and 110
    # where the chunks hold the matrices, each goes to the rank that holds most of it (nothing travels)
    held = {0: [0, 100], 1: [60, 0], 2: [50, 0], 3: [0, 10]}
    assert assign_owners({0: 100, 1: 60, 2: 50, 3: 10}, 2, held) == {0: 1, 1: 0, 2: 0, 3: 1}
    # unless that lifts a rank above 1/N of the elements: then the least loaded
    held = {i: [n, 0] for i, n in {0: 100, 1: 60, 2: 50, 3: 10}.items()}
    assert assign_owners({0: 100, 1: 60, 2: 50, 3: 10}, 2, held) == {0: 0, 1: 1, 2: 1, 3: 0}


def test_factored_moments_round_trip_exactly() -> None:
    """Adafactor's row and column moments, broadcast to the parameter's shape and read back."""
    from zeroshard.optim.matrix_state import FactoredState
    layout, shape = FactoredState(), (2, 3, 5)
    row, col = torch.rand(2, 3, 1), torch.rand(2, 1, 5)
    assert layout.keys(shape) == ("row_var", "col_var") and layout.keys((7,)) == ("variance",)
    assert torch.equal(layout.restore("row_var", layout.spread("row_var", row, shape), shape), row)
    assert torch.equal(layout.restore("col_var", layout.spread("col_var", col, shape), shape), col)


def test_every_element_travels_once_each_way() -> None:
    """At world 3 (chunks of 17 cutting two matrices), the parts sent to each owner tile every matrix's
    elements held away from it, and the parts sent back tile the same."""
    params = [torch.empty(4, 6), torch.empty(3, 9)]  # 24 + 27 = 51 elements
    builder = LayoutBuilder(params, ["a", "b"], 3)
    builder.add([0, 1], 0)
    bucket = builder.layout().buckets[0]
    comm = Collectives(World(0, 3, 0, torch.device("cpu"), "none"))  # never launches: parts are arithmetic
    plan = BucketPlan(bucket, comm, 0, bucket.shard_numel, {0: 1, 1: 2})
    for slot in bucket.slots:
        owner = plan.owners[slot.index]
        held = sorted((lo, hi) for q in range(3) for s, lo, hi in plan.parts(q, owner, owner) if s is slot)
        own = plan.held(owner, slot)
        covered = sorted(held + ([own] if own[1] > own[0] else []))
        assert covered[0][0] == 0 and covered[-1][1] == slot.numel
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        back = sorted((lo, hi) for q in range(3) for s, lo, hi in plan.parts(owner, q, owner) if s is slot)
        assert back == sorted(held)
    assert plan.moved_elements(inbound=True) == sum(
        hi - lo for s in bucket.slots for q in range(3) for _, lo, hi in plan.parts(q, plan.owners[s.index], plan.owners[s.index]))


def test_split_marks_and_refusals() -> None:
    model = Tiny()
    trainable = collect_trainable(model)
    split = split_for_muon(trainable, {})
    muon = {n for n, g in zip(split.names, split.group_of) if split.group_options[g]["use_muon"]}
    assert muon == set(MATRICES)  # the tied embedding and lm_head stay with AdamW
    marks = {id(model.up.weight): False}
    split = split_for_muon(trainable, marks)
    assert {n for n, g in zip(split.names, split.group_of) if split.group_options[g]["use_muon"]} == {"down.weight"}
    with pytest.raises(UseMuonMarkError, match="up.bias"):
        split_for_muon(trainable, {id(model.up.bias): True})
    with pytest.raises(NoMatrixError):
        split_for_muon(collect_trainable(nn.LayerNorm(3)), {})
    with pytest.raises(WholeMatrixError, match="ns_method"):
        MuonWithAuxAdam([{"params": [model.up.weight], "use_muon": True, "ns_method": "cubic"}])
    opt = MuonWithAuxAdam([{"params": [model.up.weight], "use_muon": True}])
    model(*batch(0, 1)).backward()
    with pytest.raises(WholeMatrixError, match="inside a zeroshard engine"):
        opt.step()


@pytest.mark.parametrize("stage", [0, 3])
def test_world_of_one_is_plain_muon_and_adamw_bitwise(stage: int) -> None:
    """The config's Muon at world 1 steps the matrices with the very arithmetic of torch.optim.Muon,
    bf16 Newton-Schulz included: bitwise; the rest by torch's fused AdamW, which the oracle's default
    AdamW matches to rounding (<= 1e-6)."""
    use_newton_schulz("bf16")
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2 * 2, "optimizer": {"type": "Muon", "params": PARAMS},
              "zero_optimization": {"stage": stage}}
    engine, _, _, _ = zeroshard.initialize(model=Tiny(), config=config)
    for step in range(3):
        engine.backward(engine(*batch(step, 2)))
        engine.step()
    got = engine.full_state_dict(rank0_only=False)
    want = oracle("bf16", world=2)
    for name in MATRICES:
        assert torch.equal(got[name], want[name]), name
    for name, value in want.items():
        if not name.startswith("momentum:"):
            assert float((got[name] - value).abs().max()) <= 1e-6, name


def test_world_of_one_adafactor_class_bitwise() -> None:
    torch.manual_seed(0)
    engine, _, _, _ = zeroshard.initialize(model=Tiny(), optimizer=torch.optim.Adafactor,
                                           config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}})
    torch.manual_seed(0)
    ref = Tiny()
    opt = torch.optim.Adafactor(ref.parameters())
    for step in range(3):
        engine.backward(engine(*batch(step, 2)))
        engine.step()
        ref(*batch(step, 2)).backward()
        opt.step()
        opt.zero_grad()
    got = engine.full_state_dict(rank0_only=False)
    for name, p in ref.named_parameters():
        assert torch.equal(got[name], p.detach()), name


def test_world_of_one_client_torch_muon_bitwise() -> None:
    """A client ``torch.optim.Muon`` instance over a model of matrices only (odd shapes) is stepped whole:
    bitwise torch's own (bf16 Newton-Schulz), its momentum read back through DeepSpeed's function."""
    from zeroshard.deepspeed.utils.tensor_fragment import safe_get_full_optimizer_state

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(10, 24, bias=False), nn.Tanh(), nn.Linear(24, 10, bias=False))

    use_newton_schulz("bf16")
    model, ref = build(), build()
    options = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "adjust_lr_fn": "original"}
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}
    engine, _, _, _ = zeroshard.initialize(model=model, optimizer=torch.optim.Muon(model.parameters(), **options),
                                           config=config)
    opt = torch.optim.Muon(ref.parameters(), **options)
    for step in range(3):
        x = torch.randn(4, 10, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).square().mean())
        engine.step()
        ref(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    got = engine.full_state_dict(rank0_only=False)
    for (name, p), mine in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(got[name], p.detach()), name
        assert torch.equal(safe_get_full_optimizer_state(mine, "momentum_buffer"), opt.state[p]["momentum_buffer"])
