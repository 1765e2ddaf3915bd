"""A checkpoint of a DeepSpeed model with MoE layers, read as the model with every expert.

[Note: DeepSpeed's MoE checkpoint]
DeepSpeed trains the parameters of the experts in optimizer groups of their own (``"moe": True``,
named ``ep_size_<E>``), partitioned not over the whole data-parallel world ``W`` but over the ranks
that hold the same experts: expert-parallel position ``e`` (``rank % E``) holds global experts
``e * L .. e * L + L - 1`` of each layer (``L`` = experts per layer / ``E``), and those experts'
groups are partitioned over ranks ``e, e + E, e + 2E, ...`` in that order.  The model file (written by
rank 0) holds the dense parameters in ``module``, and ``param_shapes`` lists an expert group's
parameters under rank 0's local names (``...deepspeed_experts.<i>...``), which are every rank's local
names; ``layer_<l>_expert_<x>_mp_rank_00_model_states.pt`` holds global expert ``x`` of MoE layer
``l`` under its global name.  So the dense groups merge over every rank as without experts, and each
expert group once per expert-parallel position over its ranks, its local index ``i`` renamed ``e * L +
i``: the global names zeroshard's checkpoints use ([Note: experts in a checkpoint] in
experts/checkpoint.py).  Each (group, position) gets a group index of its own, after the dense
groups, so each expert keeps the Adam step it was stepped with.  Read at ZeRO 1-2 with the same number
of experts in every MoE layer; anything else is refused by name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import torch

from ..format import CheckpointError
from .partitions import WholeState, merge_stage12
from .unpickle import load_deepspeed_file

#: where an MoE layer keeps its experts (DeepSpeed's and zeroshard's ``MoE``)
_LOCAL = "deepspeed_moe.experts.deepspeed_experts."
_EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$")
_GROUP_NAME = re.compile(r"^ep_size_(\d+)$")


def has_experts(directory: Path) -> bool:
    return any(directory.glob("*expert_*"))


def _select(sd: dict[str, Any], indices: Sequence[int]) -> dict[str, Any]:
    """A rank's ZeRO 1-2 ``optimizer_state_dict`` cut to the groups ``indices``, renumbered from 0."""
    state = sd["base_optimizer_state"]["state"]
    out = dict(sd, single_partition_of_fp32_groups=[sd["single_partition_of_fp32_groups"][i] for i in indices],
               base_optimizer_state={"state": {j: state[i] for j, i in enumerate(indices) if i in state}})
    for key in ("group_paddings", "param_alignment_paddings"):
        if sd.get(key) is not None:
            out[key] = [sd[key][i] for i in indices]
    return out


def _global_name(name: str, ep_rank: int, local_experts: int, where: str) -> str:
    head, found, tail = name.partition(_LOCAL)
    index, dot, rest = tail.partition(".")
    if not found or not dot or not index.isdigit():
        raise CheckpointError(f"{where}: {name!r} of an expert group is not an expert's parameter")
    return f"{head}{_LOCAL}{ep_rank * local_experts + int(index)}.{rest}"


def merge_moe(model: dict[str, Any], ranks: list[dict[str, Any]], where: str) -> WholeState:
    """Stages 1-2 of a model with MoE layers: ``ranks``: every rank's ``optimizer_state_dict`` (see
    [Note: DeepSpeed's MoE checkpoint])."""
    groups = [dict(g) for g in model["param_shapes"]]
    hyper = ranks[0]["base_optimizer_state"]["param_groups"]
    experts = {int(n) for n in model.get("num_experts") or []}
    if not experts:
        raise CheckpointError(f"{where}: expert files beside a model file that records no MoE layers "
                              f"(num_experts): not read")
    if len(experts) != 1:
        raise CheckpointError(f"{where}: MoE layers with different numbers of experts ({sorted(experts)}): not read")
    dense = [g for g, h in enumerate(hyper) if not h.get("moe")]
    whole = merge_stage12([groups[g] for g in dense], [_select(sd, dense) for sd in ranks], where)
    world, per_layer = len(ranks), next(iter(experts))
    for g, h in enumerate(hyper):
        if not h.get("moe"):
            continue
        match = _GROUP_NAME.match(str(h.get("name")))
        ep_size = int(match.group(1)) if match else 0
        if not ep_size or world % ep_size or per_layer % ep_size:
            raise CheckpointError(f"{where}: expert group {h.get('name')!r} at world {world} with "
                                  f"{sorted(experts)} experts a layer: not read")
        local = per_layer // ep_size
        for ep_rank in range(ep_size):
            members = [_select(ranks[r], [g]) for r in range(ep_rank, world, ep_size)]
            named = {_global_name(n, ep_rank, local, where): s for n, s in groups[g].items()}
            part = merge_stage12([named], members, f"{where} (expert group {g}, expert-parallel rank {ep_rank})")
            base = len(whole.scalars)
            whole.shapes.update(part.shapes)
            whole.tensors.update(part.tensors)
            whole.group_of.update({n: base + i for n, i in part.group_of.items()})
            whole.scalars.extend(part.scalars)
    return whole


def expert_states(directory: Path) -> dict[str, torch.Tensor]:
    """Every expert file's parameters under their global names, by MoE layer and expert."""
    named = [(p, _EXPERT_FILE.match(p.name)) for p in directory.glob("*expert_*")]
    if any(m is None for _, m in named):
        odd = sorted(p.name for p, m in named if m is None)
        raise CheckpointError(f"{directory}: DeepSpeed expert files {odd} (of a tensor-parallel job, or "
                              f"older DeepSpeed's expert_<id>_ names): not read")
    out: dict[str, torch.Tensor] = {}
    for _, _, path in sorted((int(m.group(1)), int(m.group(2)), p) for p, m in named if m is not None):
        out.update(load_deepspeed_file(path))
    return out
