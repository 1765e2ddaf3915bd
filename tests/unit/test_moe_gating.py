"""The MoE layer (zeroshard/experts/): DeepSpeed's routing rules on small fixed inputs computed by hand,
the layer's output against a per-token loop, the refused options, and the optimizer-group helpers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroshard.experts import MoE, MoENotSupported, TopKGate, top1_routing, top2_routing
from zeroshard.experts.layer import ExpertShapeError
from zeroshard.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer


def test_top1_capacity_dropping_counts_and_l_aux() -> None:
    logits = torch.tensor([[2.0, 0.0], [1.0, 0.0], [3.0, 1.0], [0.0, 1.0], [1.0, 0.5], [0.0, 2.0]])
    r = top1_routing(logits, capacity_factor=1.0, min_capacity=1, use_rts=False)
    gates = logits.softmax(dim=1)
    assert r.capacity == 3  # ceil(6 / 2 * 1.0)
    assert r.exp_counts.tolist() == [4, 2]  # before dropping
    expected = 2 * (gates.mean(dim=0) * torch.tensor([4 / 6, 2 / 6])).sum()
    assert torch.allclose(r.l_aux, expected)
    # expert 0 keeps its first three tokens (0, 1, 2); token 4 is dropped
    kept = {(s, e, c) for s, e, c in r.dispatch.nonzero().tolist()}
    assert kept == {(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (5, 1, 1)}
    assert torch.allclose(r.combine[2, 0, 2], gates[2, 0])
    assert r.combine[4].abs().sum() == 0
    assert top1_routing(logits, 1.0, min_capacity=5, use_rts=False).capacity == 5
    assert top1_routing(logits, 1.0, min_capacity=1, drop_tokens=False).capacity == 4
    rts = top1_routing(logits, 1.0, min_capacity=1, use_rts=True)  # a random 3 of expert 0's 4 tokens
    assert int(rts.dispatch[:, 0].sum()) == 3 and int(rts.dispatch[:, 1].sum()) == 2


def test_top2_capacity_dropping_normalisation_and_l_aux() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0], [2.0, 0.0, 1.0], [1.0, 2.0, 0.0]])
    r = top2_routing(logits, capacity_factor=0.5, min_capacity=1, second_expert_sampling=False)
    gates = logits.softmax(dim=1)
    assert r.capacity == 2  # ceil(4 / 3 * 2 * 0.5)
    assert r.exp_counts.tolist() == [4, 3, 1]
    expected = 3 * (gates.mean(dim=0) * torch.tensor([3 / 4, 1 / 4, 0.0])).sum()
    assert torch.allclose(r.l_aux, expected)
    weights = r.combine.sum(dim=2)  # [s, e]
    # token 0 keeps both choices (expert 1's second slot, after token 3's first choice)
    assert torch.allclose(weights[0], torch.stack([gates[0, 0], gates[0, 1], torch.tensor(0.0)]) /
                          (gates[0, 0] + gates[0, 1]))
    # token 1's second choice and token 2's first are over capacity: the kept one weighs 1
    assert torch.allclose(weights[1], torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(weights[2], torch.tensor([0.0, 0.0, 1.0]))
    assert torch.allclose(weights[3], torch.tensor([0.0, 1.0, 0.0]))  # expert 0 is full for its second choice
    assert top2_routing(logits, 0.5, 1, drop_tokens=False, second_expert_sampling=False).capacity == 4


def test_eval_capacity_factor_and_noise_only_in_training() -> None:
    gate = TopKGate(4, 2, k=1, capacity_factor=1.0, eval_capacity_factor=3.0, min_capacity=1,
                    noisy_gate_policy="Jitter", use_rts=False)
    x = torch.randn(8, 4)
    assert gate.train()(x).capacity == 4
    evaluated = gate.eval()(x)
    assert evaluated.capacity == 12
    assert torch.equal(evaluated.combine, gate(x).combine)  # no jitter in eval: deterministic


def test_layer_output_is_the_gate_weighted_sum_of_experts() -> None:
    torch.manual_seed(0)
    moe = MoE(6, nn.Sequential(nn.Linear(6, 6), nn.Tanh()), num_experts=3, k=2, min_capacity=0,
              drop_tokens=False, top2_2nd_expert_sampling=False)
    x = torch.randn(2, 5, 6)
    out, l_aux, counts = moe(x)
    assert out.shape == x.shape and l_aux.dim() == 0 and int(counts.sum()) == 20
    tokens = x.reshape(-1, 6)
    gates = moe.deepspeed_moe.gate.wg(tokens).softmax(dim=1)
    top = gates.topk(2, dim=1)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    expected = torch.stack([sum(w / top.values[s].sum() * experts[int(e)](tokens[s])
                                for w, e in zip(top.values[s], top.indices[s])) for s in range(10)])
    assert torch.allclose(out.reshape(-1, 6), expected, atol=1e-6)


def test_residual_moe_mixes_a_dense_expert() -> None:
    moe = MoE(4, nn.Linear(4, 4), num_experts=2, use_residual=True, use_rts=False)
    out, _, _ = moe(torch.randn(8, 4))
    assert out.shape == (8, 4) and {"mlp.weight", "coefficient.weight"} <= set(dict(moe.named_parameters()))
    assert not is_moe_param(moe.mlp.weight) and not is_moe_param(moe.coefficient.weight)


@pytest.mark.parametrize("option", [{"use_tutel": True}, {"enable_expert_tensor_parallelism": True}])
def test_unsupported_moe_options_are_refused(option: dict) -> None:
    with pytest.raises(MoENotSupported, match="not supported by zeroshard"):
        MoE(4, nn.Linear(4, 4), num_experts=2, **option)


def test_expert_params_split_into_their_own_group() -> None:
    moe = MoE(4, nn.Linear(4, 4), num_experts=2)
    experts = list(moe.deepspeed_moe.experts.parameters())
    assert all(is_moe_param(p) for p in experts) and not is_moe_param(moe.deepspeed_moe.gate.wg.weight)
    assert not hasattr(experts[0], "allreduce")  # nothing set on the tensors
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(moe.parameters()), "name": "dense", "weight_decay": 0.1})
    assert [(g["name"], g.get("moe", False), len(g["params"]), g["weight_decay"]) for g in groups] == [
        ("dense", False, 1, 0.1), ("ep_size_1", True, 4, 0.1)]
    capped = split_params_into_different_moe_groups_for_optimizer([{"params": experts}], max_group_size=20)
    assert [len(g["params"]) for g in capped] == [0, 2, 2]  # 16 + 4 + 16 + 4 elements, a cap of 20


def test_an_expert_must_keep_its_input_shape() -> None:
    moe = MoE(4, nn.Linear(4, 5), num_experts=2)
    with pytest.raises(ExpertShapeError, match="must return its input's shape"):
        moe(torch.randn(6, 4))


def test_expert_groups_exist_only_inside_an_engine() -> None:
    from zeroshard.deepspeed.utils import groups

    with pytest.raises(groups.GroupsNotBuiltError, match="initialize"):
        groups._get_expert_parallel_group("ep_size_2")
    with pytest.raises(groups.GroupsNotBuiltError, match="deprecated"):
        groups.initialize(ep_size=2)
