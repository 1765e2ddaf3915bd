"""Tiled compute along the sequence (zeroshard/sequence/tiled.py: DeepSpeed's ``TiledMLP`` and
``sequence_tiled_compute``) equals the untiled computation, outputs and gradients, and each parameter's
gradient arrives once per backward ([Note: a tiled computation's backward])."""

from __future__ import annotations

import torch
from torch import nn

from zeroshard.sequence import TiledMLP, sequence_tiled_compute


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def arrivals(module: nn.Module) -> dict[str, int]:
    counts = {name: 0 for name, _ in module.named_parameters()}
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


def grads_of(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]


def test_tiled_mlp_equals_the_mlp_and_each_parameter_gets_one_gradient() -> None:
    torch.manual_seed(0)
    mlp = MLP()
    x = torch.randn(2, 10, 8, requires_grad=True)
    weight = torch.randn(2, 10, 8)
    (mlp(x) * weight).sum().backward()
    expected_out, expected = mlp(x).detach(), grads_of(mlp, x)
    for shards, params in ((3, None), (4, [mlp.gate.weight, mlp.up.weight, mlp.down.weight, mlp.down.bias])):
        mlp.zero_grad()
        x.grad = None
        counts = arrivals(mlp)
        out = TiledMLP.apply(lambda module, part: module(part), mlp, x, shards, params)
        torch.testing.assert_close(out, expected_out, rtol=1e-6, atol=1e-7)
        (out * weight).sum().backward()
        for got, want in zip(grads_of(mlp, x), expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert set(counts.values()) == {1}, counts


def test_sequence_tiled_compute_of_a_loss_equals_the_untiled_loss() -> None:
    torch.manual_seed(0)
    head = nn.Linear(8, 11, bias=False)
    hidden = torch.randn(2, 9, 8, requires_grad=True)
    labels = torch.randint(0, 11, (2, 9))
    labels[0, :4] = -100

    def loss_sum(hidden_states: torch.Tensor, shift_labels: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        logits = lm_head(hidden_states).float()
        return nn.functional.cross_entropy(logits.reshape(-1, 11), shift_labels.reshape(-1), ignore_index=-100,
                                           reduction="sum")

    loss_sum(hidden, labels, head).backward()
    expected = [hidden.grad.clone(), head.weight.grad.clone()]
    want = float(loss_sum(hidden, labels, head))
    hidden.grad, head.weight.grad = None, None
    total = sequence_tiled_compute(loss_sum, 9, 4, {"hidden_states": hidden, "shift_labels": labels},
                                   {"lm_head": head}, "hidden_states", [head.weight], output_unshard_dimension=0,
                                   output_reduction="sum")
    assert abs(float(total) - want) <= 1e-5 * abs(want)
    total.backward()
    torch.testing.assert_close(hidden.grad, expected[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(head.weight.grad, expected[1], rtol=1e-5, atol=1e-7)
    # the outputs side by side, and their mean
    logits = sequence_tiled_compute(lambda hidden_states: head(hidden_states), 9, 2, {"hidden_states": hidden}, {},
                                    "hidden_states", [head.weight], output_reduction=None)
    torch.testing.assert_close(logits, head(hidden), rtol=1e-6, atol=1e-7)
    mean = sequence_tiled_compute(lambda hidden_states: hidden_states.sum(), 9, 3, {"hidden_states": hidden}, {},
                                  "hidden_states", output_unshard_dimension=0, output_reduction="mean")
    torch.testing.assert_close(mean, hidden.sum() / 3)
