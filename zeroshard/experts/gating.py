"""The router of an MoE layer: which experts each token goes to, with which weight, and within which capacity.

Shapes: ``s`` tokens, ``e`` experts, ``c`` slots per expert (the capacity).  Everything here runs in fp32.

[Note: DeepSpeed's routing rules]
The rules are DeepSpeed's, so that a model trained there trains the same here:
- capacity = max(ceil(s / e * capacity_factor), min_capacity), with capacity_factor doubled for top-2
  (each token takes two slots); the eval factor applies outside training.  Without ``drop_tokens`` the
  capacity is the largest number of tokens routed to one expert, so no token is dropped.
- l_aux = e * sum over experts of (mean gate probability) * (fraction of tokens whose *first* choice
  it is), counted before dropping; ``exp_counts`` is the tokens routed per expert before dropping (both
  choices at top-2).
- top-1 weights a token by its gate probability; top-2 by the two probabilities normalised over the
  choices that kept a slot (a token whose second choice was dropped gets its first expert at weight 1).
- over capacity, top-1 keeps a random subset (``use_rts``) or the first tokens; top-2 keeps first
  choices before second choices, each in token order.
- noise: "Jitter" scales the router's input by U(1-eps, 1+eps) in training; "RSample" adds gumbel noise
  to the logits for the top-1 choice in training; top-2 picks its second expert from gumbel-noised
  logits whenever ``second_expert_sampling`` is on, in training and eval alike, as DeepSpeed does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")

#: a capacity -> the one every rank exchanging tokens uses
Agree = Callable[[int], int]
JITTER_EPSILON = 1e-2


@dataclass
class Routing:
    """The router's decision for ``s`` tokens."""

    l_aux: Tensor  # scalar, the load-balancing loss
    combine: Tensor  # [s, e, c] the weight of each token's output in each expert slot (0: not there)
    dispatch: Tensor  # [s, e, c] bool, where each token is placed
    exp_counts: Tensor  # [e] tokens routed per expert before dropping

    @property
    def capacity(self) -> int:
        return int(self.combine.shape[2])


def capacity_for(tokens: int, experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert when tokens over capacity are dropped."""
    return max(math.ceil(tokens / experts * capacity_factor), min_capacity)


def gumbel_noise(like: Tensor) -> Tensor:
    uniform = torch.rand_like(like).clamp(min=torch.finfo(like.dtype).tiny, max=1.0 - torch.finfo(like.dtype).eps)
    return -torch.log(-torch.log(uniform))


def _load_loss(gates: Tensor, first: Tensor) -> Tensor:
    experts = gates.shape[1]
    return (gates.mean(dim=0) * first.float().mean(dim=0)).sum() * experts


def _place(weights: Tensor, slots: Tensor, capacity: int) -> Tensor:
    """[s, e] weights of kept routes and [s] slot of each token's route -> [s, e, c] combine weights."""
    return weights.unsqueeze(2) * F.one_hot(slots, num_classes=capacity).to(weights.dtype).unsqueeze(1)


def _keep_first(mask: Tensor, capacity: int, offset: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Keep, per expert, the routes whose slot (order among the expert's routes, after ``offset``) is
    within capacity.  Returns the kept mask and each token's slot (0 where it has none)."""
    slots = torch.cumsum(mask, dim=0) - 1
    if offset is not None:
        slots = slots + offset
    kept = mask * (slots < capacity)
    return kept, (slots * kept).sum(dim=1)


def _keep_random(mask: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """Keep, per expert, ``capacity`` of its routes chosen at random; slots in token order."""
    priority = mask * torch.rand(mask.shape, device=mask.device)
    chosen = torch.topk(priority, k=min(capacity, mask.shape[0]), dim=0).indices
    kept = mask * torch.zeros_like(mask).scatter_(0, chosen, 1)
    return _keep_first(kept, capacity)


def top1_routing(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Optional[Tensor] = None,
                 noisy_logits: Optional[Tensor] = None, drop_tokens: bool = True, use_rts: bool = True,
                 agree: Optional[Agree] = None) -> Routing:
    """Each token to its most probable expert (chosen on ``noisy_logits`` where given); ``agree``: the
    capacity the ranks exchanging tokens take, when no token is dropped."""
    gates = F.softmax(logits, dim=1)
    tokens, experts = gates.shape
    choice = torch.argmax(noisy_logits if noisy_logits is not None else gates, dim=1)
    mask = F.one_hot(choice, num_classes=experts)
    if used_token is not None:
        mask = mask * used_token.to(mask.dtype).unsqueeze(1)
    exp_counts = mask.sum(dim=0).detach()
    if drop_tokens:
        capacity = capacity_for(tokens, experts, capacity_factor, min_capacity)
    else:
        capacity = max(min(int(exp_counts.max()), tokens), 1)
        capacity = agree(capacity) if agree is not None else capacity
    l_aux = _load_loss(gates, mask)
    kept, slots = _keep_random(mask, capacity) if use_rts else _keep_first(mask, capacity)
    combine = _place(gates * kept.to(gates.dtype), slots, capacity)
    return Routing(l_aux, combine, combine.bool(), exp_counts)


def top2_routing(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Optional[Tensor] = None,
                 drop_tokens: bool = True, second_expert_sampling: bool = True,
                 agree: Optional[Agree] = None) -> Routing:
    """Each token to its two most probable experts (the second sampled with gumbel noise when asked);
    ``agree`` as for :func:`top1_routing`."""
    gates = F.softmax(logits, dim=1)
    tokens, experts = gates.shape
    first = F.one_hot(torch.argmax(gates, dim=1), num_classes=experts)
    second_logits = logits + gumbel_noise(logits) if second_expert_sampling else logits
    second = F.one_hot(torch.argmax(second_logits.masked_fill(first.bool(), float("-inf")), dim=1),
                       num_classes=experts)
    if used_token is not None:
        first = first * used_token.to(first.dtype).unsqueeze(1)
        second = second * used_token.to(second.dtype).unsqueeze(1)
    l_aux = _load_loss(gates, first)
    exp_counts = (first + second).sum(dim=0).detach()
    if drop_tokens:
        capacity = capacity_for(tokens, experts, 2 * capacity_factor, min_capacity)
    else:
        capacity = max(int(exp_counts.max()), 1)
        capacity = agree(capacity) if agree is not None else capacity
    # second choices queue behind every first choice of their expert, dropped or not
    kept1, slots1 = _keep_first(first, capacity)
    kept2, slots2 = _keep_first(second, capacity, offset=first.sum(dim=0, keepdim=True))
    gate1 = (gates * kept1.to(gates.dtype)).sum(dim=1)
    gate2 = (gates * kept2.to(gates.dtype)).sum(dim=1)
    total = torch.clamp(gate1 + gate2, min=torch.finfo(gates.dtype).eps)
    combine = (_place(kept1.to(gates.dtype) * (gate1 / total).unsqueeze(1), slots1, capacity)
               + _place(kept2.to(gates.dtype) * (gate2 / total).unsqueeze(1), slots2, capacity))
    return Routing(l_aux, combine, combine.bool(), exp_counts)


class TopKGate(nn.Module):
    """The router: a linear map ``model_dim -> num_experts`` without bias, in fp32, and the top-k rule."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"k={k}: zeroshard's MoE routes each token to 1 or 2 experts")
        if noisy_gate_policy == "None":
            noisy_gate_policy = None
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r}: expected one of {NOISY_GATE_POLICIES}")
        self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        self.k, self.capacity_factor, self.eval_capacity_factor = k, capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts, self.top2_2nd_expert_sampling = drop_tokens, use_rts, top2_2nd_expert_sampling

    def forward(self, tokens: Tensor, used_token: Optional[Tensor] = None, agree: Optional[Agree] = None) -> Routing:
        """``tokens``: [s, model_dim]; ``agree``: see :func:`top1_routing`."""
        x = tokens.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * torch.empty_like(x).uniform_(1.0 - JITTER_EPSILON, 1.0 + JITTER_EPSILON)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            noisy = logits + gumbel_noise(logits) if self.noisy_gate_policy == "RSample" and self.training else None
            return top1_routing(logits, factor, self.min_capacity, used_token, noisy, self.drop_tokens, self.use_rts,
                                agree)
        return top2_routing(logits, factor, self.min_capacity, used_token, self.drop_tokens,
                            self.top2_2nd_expert_sampling, agree)
