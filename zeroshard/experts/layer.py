"""``MoE``: DeepSpeed's mixture-of-experts layer, every expert on every rank or spread over ranks.

[Note: experts are data parallel]
With expert-parallel size 1 every rank holds every expert, so an expert's parameters are ordinary
data-parallel parameters: ZeRO shards them and reduces their gradients like any other, at every stage,
and nothing moves tokens between ranks.  Each rank routes its own tokens (capacity, dropping and l_aux
are computed per rank, as in DeepSpeed).  Every expert runs on its whole slot buffer, padded with zero
tokens, so each expert parameter is used in every step whatever the routing.  With ``ep_size`` > 1 a
rank holds ``num_experts / ep_size`` experts and the slot buffers travel to their experts' ranks and
back by all-to-all over the expert-parallel group, which ``initialize()`` builds and binds (see [Note:
experts sharded over the ranks that hold them] in experts/groups.py); without ``drop_tokens`` the ranks
of a group first agree on the largest capacity, so that the buffers they exchange have one shape.
Tutel's CUDA kernels and expert tensor parallelism are refused by name.

Module names follow DeepSpeed's (``deepspeed_moe.gate.wg``, ``deepspeed_moe.experts.deepspeed_experts.N``
with N the local index, ``mlp`` and ``coefficient`` for the residual), so state dicts keep their keys
across the two.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed.collectives import Collectives
from ..errors import NotSupportedByZeroshard
from .gating import TopKGate
from .groups import ExpertParallelError, exchange
from .registry import EXPERT_GROUP_NAME, register_expert_params


class ExpertShapeError(ValueError):
    """An expert whose output shape differs from its input's."""


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
        outputs = [_first(expert(slots[i])) for i, expert in enumerate(self.deepspeed_experts)]
        if outputs and outputs[0].shape != slots.shape[1:]:
            raise ExpertShapeError(
                f"an expert maps its tokens of shape {tuple(slots.shape[1:])} to {tuple(outputs[0].shape)}: an MoE "
                f"layer's expert must return its input's shape (hidden_size in, hidden_size out), since its "
                f"output is combined with the other experts' into the layer's output")
        return torch.stack(outputs)


class MOELayer(nn.Module):
    """Route, run the experts on their slots, combine; keeps the last ``l_aux`` and ``exp_counts``."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_size: int = 1) -> None:
        super().__init__()
        self.gate, self.experts, self.ep_size = gate, experts, ep_size
        self.l_aux: Optional[Tensor] = None
        self.exp_counts: Optional[Tensor] = None
        #: the expert-parallel group (``ep_size`` > 1) and the whole data-parallel world, which agrees on
        #: the capacity, bound by ``initialize()``
        self.exchange: Optional[Collectives] = None
        self.world: Optional[Collectives] = None

    def forward(self, hidden_states: Tensor, used_token: Optional[Tensor] = None) -> Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        routing = self.gate(tokens, used_token, self._agree_capacity if self.ep_size > 1 else None)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        slots = torch.einsum("sec,sm->ecm", routing.dispatch.to(tokens.dtype), tokens)
        out = self.experts(slots) if self.ep_size == 1 else self._experts_elsewhere(slots)
        combined = torch.einsum("sec,ecm->sm", routing.combine.to(out.dtype), out)
        return combined.reshape(hidden_states.shape[:-1] + combined.shape[-1:])

    def _group(self) -> Collectives:
        if self.exchange is None:
            raise ExpertParallelError(
                f"MoE(ep_size={self.ep_size}) exchanges tokens over its expert-parallel group, which "
                f"zeroshard.initialize() builds: run the model through the engine initialize() returns")
        return self.exchange

    def _agree_capacity(self, capacity: int) -> int:
        """Without token dropping: the largest capacity of any rank, as DeepSpeed takes it (every
        expert-parallel group then exchanges buffers of one shape)."""
        self._group()
        assert self.world is not None
        agreed = torch.tensor([float(capacity)], device=self.world.world.device)
        self.world.all_reduce(agreed, "moe_capacity", op=torch.distributed.ReduceOp.MAX)
        return int(agreed.item())

    def _experts_elsewhere(self, slots: Tensor) -> Tensor:
        """[e, c, m] slots of every expert -> each expert's output on them, computed on its own rank."""
        group, ep = self._group(), self.ep_size
        experts, capacity, width = slots.shape
        local = experts // ep
        # chunk r (experts r*local ..) to rank r; received: [source rank, local expert, c, m]
        received = exchange(group, slots.reshape(ep, local, capacity, width), "moe_dispatch")
        mine = received.transpose(0, 1).reshape(local, ep * capacity, width)
        out = self.experts(mine).reshape(local, ep, capacity, -1).transpose(0, 1)
        return exchange(group, out, "moe_combine").reshape(experts, capacity, -1)


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE`` (its arguments; see [Note: DeepSpeed's routing rules] in
    experts/gating.py).  ``forward(hidden_states, used_token=None) -> (output, l_aux, exp_counts)``."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        _refuse_unsupported(use_tutel, enable_expert_tensor_parallelism)
        if num_experts < 1:
            raise ValueError(f"num_experts={num_experts}: an MoE layer needs at least one expert")
        if ep_size < 1 or num_experts % ep_size:
            raise ExpertParallelError(f"MoE(num_experts={num_experts}, ep_size={ep_size}): ep_size must be a "
                                      f"positive divisor of num_experts (each rank of an expert-parallel group "
                                      f"holds num_experts / ep_size experts)")
        self.ep_size, self.num_experts, self.num_local_experts = ep_size, num_experts, num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.use_residual = use_residual
        self.deepspeed_moe = MOELayer(
            TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                     noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling),
            Experts(expert, self.num_local_experts, self.expert_group_name), ep_size)
        if use_residual:
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)

    def bind(self, exchange: Optional[Collectives], world: Optional[Collectives]) -> None:
        """The expert-parallel group this layer's tokens travel over and the data-parallel world
        (``initialize()`` binds them)."""
        self.deepspeed_moe.exchange, self.deepspeed_moe.world = exchange, world

    def forward(self, hidden_states: Tensor, used_token: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = _first(self.mlp(hidden_states))
            mix = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * mix[..., 0:1] + dense * mix[..., 1:]
        assert self.deepspeed_moe.l_aux is not None and self.deepspeed_moe.exp_counts is not None
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def _refuse_unsupported(use_tutel: bool, enable_expert_tensor_parallelism: bool) -> None:
    if use_tutel:
        raise MoENotSupported("MoE(use_tutel=True) is not supported by zeroshard: tutel is a library of CUDA "
                              "kernels for expert dispatch, which zeroshard does not use. Leave use_tutel=False.")
    if enable_expert_tensor_parallelism:
        raise MoENotSupported("MoE(enable_expert_tensor_parallelism=True) is not supported by zeroshard: "
                              "experts split by tensor parallelism (expert and tensor "
                              "parallel groups together) is not implemented. Leave it False.")


def expert_parallel_size(model: nn.Module) -> int:
    """The ``ep_size`` of the model's MoE layers (1 without any); several different sizes are refused."""
    sizes = sorted({m.ep_size for m in model.modules() if isinstance(m, MoE)})
    if len(sizes) > 1:
        raise ExpertParallelError(f"the model's MoE layers have ep_size {sizes}: zeroshard builds one set of "
                                  f"expert groups per job; give every MoE layer the same ep_size")
    return sizes[0] if sizes else 1


def checked_expert_axis(model: nn.Module, axis: int, shares_plain_world: bool, built_under_init: bool) -> int:
    """The model's MoE layers' ``ep_size``, checked against the job's expert axis (see [Note: experts
    sharded over the ranks that hold them] in experts/groups.py); ``shares_plain_world``: no MiCS / hpZ
    groups, pipeline or tensor parallelism."""
    ep_size = expert_parallel_size(model)
    if ep_size != axis:
        raise ExpertParallelError(f"the model's MoE layers have ep_size={ep_size}, but the job's axes were "
                                  f"built with an expert axis of {axis}")
    if ep_size > 1 and not shares_plain_world:
        raise ExpertParallelError(
            f"MoE(ep_size={ep_size}) with MiCS / hpZ groups, pipeline or tensor parallelism is not "
            f"supported yet: expert parallelism runs over a plain data-parallel world")
    if ep_size > 1 and built_under_init:
        raise ExpertParallelError(
            f"MoE(ep_size={ep_size}) in a model built under zeroshard.Init is not supported yet: Init shards "
            f"every parameter over the whole world, experts included; build the model outside Init (stage 3 "
            f"moves it to the device bucket by bucket)")
    return ep_size


def bind_expert_groups(model: nn.Module, exchange: Optional[Collectives], world: Optional[Collectives]) -> None:
    """Give every MoE layer of ``model`` the expert-parallel group its tokens travel over and the
    data-parallel world."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.bind(exchange, world)
