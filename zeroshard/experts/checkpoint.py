"""Checkpoints and full weights of a model whose experts are spread over ranks (expert parallelism).

[Note: experts in a checkpoint]
A checkpoint is read by parameter name and flat range, so experts are saved under the names they have
in the same model with every expert on one rank: a rank of expert-parallel position e holding L experts
per layer writes its local expert i as global expert ``e * L + i``.  Its experts' buckets are numbered
apart from every other rank's (the engine's index plus ``e`` times the number of buckets, dense buckets
keeping theirs) and their chunk ``c`` is in the file of rank ``e + c * ep_size``: the ranks holding
the same experts are every ``ep_size``-th rank, as the groups are laid out ([Note: experts sharded over
the ranks that hold them] in experts/groups.py), which the manifest records per bucket as
``rank_base`` and ``rank_stride``.  The ranks holding their experts' first chunks (ranks 0 ..
ep_size-1) send rank 0 their buckets and keys, and rank 0 writes one manifest naming every expert.
Nothing else depends on the layout: a load at another expert-parallel size, data-parallel degree or
ZeRO stage, or into the plain model in one process, reads by name the experts each rank holds now,
and ``zeroshard consolidate`` writes the model with every expert.  ``full_state_dict()`` and
``save_16bit_model()`` gather every rank's experts the same way, by all-gather over the
expert-parallel group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..checkpoint.interface import CheckpointParts, ShardedStateful, SpreadExperts
from ..checkpoint.job import JobNamedModule, RenamedShards
from ..distributed.collectives import Collectives
from ..sharding.layout import BucketLayout
from .layer import MoE

#: where the experts of an MoE layer named ``prefix`` live: ``{prefix}.{EXPERTS}{local index}.``
EXPERTS = "deepspeed_moe.experts.deepspeed_experts."


class ExpertStateError(ValueError):
    """Experts with state zeroshard cannot place by expert yet (frozen expert parameters, buffers)."""


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts this rank holds: its position ``ep_rank`` in its expert-parallel group of
    ``ep_size``, ``local_experts`` per MoE layer, the layers' module names (``prefixes``), and
    whether it holds its experts' first chunks (``leads``)."""

    ep_size: int
    ep_rank: int
    local_experts: int
    prefixes: tuple[str, ...]
    leads: bool
    exchange: Collectives

    @staticmethod
    def of(model: nn.Module, exchange: Collectives, experts_data: Collectives) -> "ExpertPlacement":
        layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
        for name, layer in layers:
            experts = layer.deepspeed_moe.experts
            frozen = [n for n, p in experts.named_parameters() if not p.requires_grad]
            if frozen or any(True for _ in experts.buffers()):
                raise ExpertStateError(
                    f"MoE layer {name!r} (ep_size={layer.ep_size}) has experts with frozen parameters or "
                    f"buffers ({frozen[:3] or 'buffers'}): with expert parallelism only trainable expert "
                    f"parameters are supported yet")
        local = {m.num_local_experts for _, m in layers}
        assert len(local) == 1, "one ep_size per job: every layer holds num_experts / ep_size experts"
        return ExpertPlacement(exchange.world.world_size, exchange.world.rank, local.pop(),
                               tuple(f"{name}." if name else "" for name, _ in layers),
                               experts_data.world.rank == 0, exchange)

    def _split(self, name: str) -> Optional[tuple[str, int, str]]:
        """``(prefix, local index, rest)`` of an expert's parameter name, None for any other name."""
        for prefix in self.prefixes:
            head = prefix + EXPERTS
            if name.startswith(head):
                index, rest = name[len(head):].split(".", 1)
                return head, int(index), rest
        return None

    def global_name(self, name: str) -> str:
        """``name`` in the model with every expert on one rank."""
        split = self._split(name)
        if split is None:
            return name
        head, index, rest = split
        return f"{head}{self.ep_rank * self.local_experts + index}.{rest}"

    def every_name(self, names: list[str]) -> frozenset[str]:
        """The names of every rank's experts, from this rank's ``names``."""
        out: set[str] = set()
        for name in names:
            split = self._split(name)
            if split is not None:
                head, index, rest = split
                out.update(f"{head}{e * self.local_experts + index}.{rest}" for e in range(self.ep_size))
        return frozenset(out)


class ExpertNamedShards(RenamedShards):
    """This rank's shards with its experts under their global names, their buckets numbered apart from
    every other rank's and saved by every ``ep_size``-th rank (see [Note: experts in a checkpoint])."""

    def __init__(self, inner: ShardedStateful, placement: ExpertPlacement) -> None:
        self.placement = placement
        count = len(inner.layout.buckets)
        named = []
        for bucket in inner.layout.buckets:
            if bucket.experts:
                slots = tuple(dataclasses.replace(s, name=placement.global_name(s.name)) for s in bucket.slots)
                named.append((dataclasses.replace(bucket, index=bucket.index + placement.ep_rank * count,
                                                  slots=slots), bucket))
            else:
                named.append((bucket, bucket))
        super().__init__(inner, named)

    def chunk_ranks(self, bucket: BucketLayout) -> tuple[int, int]:
        if bucket.experts:
            return self.placement.ep_rank, self.placement.ep_size
        return super().chunk_ranks(bucket)


def expert_parts(parts: CheckpointParts, placement: ExpertPlacement, param_names: list[str]) -> CheckpointParts:
    """An engine's ``parts`` with its experts under their global names (see [Note: experts in a checkpoint])."""
    return dataclasses.replace(parts, shards=ExpertNamedShards(parts.shards, placement),
                               module=JobNamedModule(parts.module, placement.global_name),
                               experts=SpreadExperts(placement.leads, placement.every_name(param_names)))


def with_every_expert(state: dict[str, torch.Tensor], placement: ExpertPlacement, keep: bool
                      ) -> dict[str, torch.Tensor]:
    """A full state dict of this rank's model (local names; every rank calls it) as the model with every
    expert: each expert tensor all-gathered over the expert-parallel group, under its global names."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        split = placement._split(name)
        if split is None:
            out[name] = tensor
            continue
        head, index, rest = split
        every = torch.empty((placement.ep_size, *tensor.shape), dtype=tensor.dtype,
                            device=placement.exchange.world.device)
        placement.exchange.all_gather(every.view(-1), tensor.to(every.device).reshape(-1), f"full_experts.{name}")
        if keep:
            for e in range(placement.ep_size):
                out[f"{head}{e * placement.local_experts + index}.{rest}"] = every[e].to("cpu", copy=True)
    return out if keep else {}
