"""``MoE``: DeepSpeed's mixture-of-experts layer, with every expert on every rank.

[Note: experts are data parallel]
With expert-parallel size 1 every rank holds every expert, so an expert's parameters are ordinary
data-parallel parameters: ZeRO shards them and reduces their gradients like any other, at every stage,
and nothing moves tokens between ranks.  Each rank routes its own tokens (capacity, dropping and l_aux
are computed per rank, as in DeepSpeed).  Every expert runs on its whole slot buffer, padded with zero
tokens, so each expert parameter is used in every step whatever the routing.  Expert parallelism
(all-to-all of tokens, experts sharded over expert-data-parallel groups) is not here and is refused by
name, as are tutel's CUDA kernels and expert tensor parallelism.

Module names follow DeepSpeed's (``deepspeed_moe.gate.wg``, ``deepspeed_moe.experts.deepspeed_experts.N``,
``mlp`` and ``coefficient`` for the residual), so state dicts keep their keys across the two.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..deepspeed.refused import NotSupportedByZeroshard
from .gating import TopKGate
from .registry import EXPERT_GROUP_NAME, register_expert_params


class MoENotSupported(NotSupportedByZeroshard):
    """An MoE option that needs expert parallelism or a CUDA kernel library zeroshard does not have."""


def _first(output: Any) -> Tensor:
    """An expert (or the residual MLP) may return ``(output, bias)``; the bias is ignored, as in DeepSpeed."""
    return output[0] if isinstance(output, tuple) else output


class Experts(nn.Module):
    """``num_experts`` deep copies of one expert, each applied to its own slot buffer."""

    def __init__(self, expert: nn.Module, num_experts: int, group_name: str = EXPERT_GROUP_NAME) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_experts))
        register_expert_params(self, group_name)

    def forward(self, slots: Tensor) -> Tensor:
        """``slots``: [e, c, m] -> [e, c, m]."""
        return torch.stack([_first(expert(slots[i])) for i, expert in enumerate(self.deepspeed_experts)])


class MOELayer(nn.Module):
    """Route, run the experts on their slots, combine; keeps the last ``l_aux`` and ``exp_counts``."""

    def __init__(self, gate: TopKGate, experts: Experts) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts
        self.l_aux: Optional[Tensor] = None
        self.exp_counts: Optional[Tensor] = None

    def forward(self, hidden_states: Tensor, used_token: Optional[Tensor] = None) -> Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        routing = self.gate(tokens, used_token)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        slots = torch.einsum("sec,sm->ecm", routing.dispatch.to(tokens.dtype), tokens)
        out = self.experts(slots)
        combined = torch.einsum("sec,ecm->sm", routing.combine.to(out.dtype), out)
        return combined.reshape(hidden_states.shape[:-1] + combined.shape[-1:])


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE`` (its arguments; see [Note: DeepSpeed's routing rules] in
    experts/gating.py).  ``forward(hidden_states, used_token=None) -> (output, l_aux, exp_counts)``."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        _refuse_unsupported(ep_size, use_tutel, enable_expert_tensor_parallelism)
        if num_experts < 1:
            raise ValueError(f"num_experts={num_experts}: an MoE layer needs at least one expert")
        self.ep_size, self.num_experts, self.num_local_experts = ep_size, num_experts, num_experts
        self.expert_group_name = f"ep_size_{ep_size}"
        self.use_residual = use_residual
        self.deepspeed_moe = MOELayer(
            TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                     noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling),
            Experts(expert, num_experts, self.expert_group_name))
        if use_residual:
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)

    def forward(self, hidden_states: Tensor, used_token: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = _first(self.mlp(hidden_states))
            mix = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * mix[..., 0:1] + dense * mix[..., 1:]
        assert self.deepspeed_moe.l_aux is not None and self.deepspeed_moe.exp_counts is not None
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def _refuse_unsupported(ep_size: int, use_tutel: bool, enable_expert_tensor_parallelism: bool) -> None:
    if ep_size != 1:
        raise MoENotSupported(
            f"MoE(ep_size={ep_size}) is not supported by zeroshard: expert parallelism (experts spread over "
            f"ranks, tokens exchanged by all-to-all, expert-data-parallel sharding) is not implemented. Use "
            f"ep_size=1: every rank holds every expert and ZeRO shards them like any parameter.")
    if use_tutel:
        raise MoENotSupported("MoE(use_tutel=True) is not supported by zeroshard: tutel is a library of CUDA "
                              "kernels for expert dispatch, which zeroshard does not use. Leave use_tutel=False.")
    if enable_expert_tensor_parallelism:
        raise MoENotSupported("MoE(enable_expert_tensor_parallelism=True) is not supported by zeroshard: "
                              "experts split by tensor parallelism need expert parallel groups, which are not "
                              "implemented. Leave it False.")
