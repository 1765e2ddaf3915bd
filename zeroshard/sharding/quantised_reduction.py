"""ZeRO++'s qgZ: each gradient bucket reduced to its owners by two all-to-alls of block-quantised values,
inside the node then across nodes (``zero_quantized_gradients``), in place of the reduce-scatter.

[Note: gradients reduced in two quantised hops]
The shard group's N ranks are M nodes of L consecutive ranks; rank ``r = m L + l`` owns chunk r of a
bucket of N chunks of S elements.  Hop one, inside the node: each rank sends to each local peer l' the
M chunks whose owners have local index l' (those of ranks ``m' L + l'``), quantised in blocks
(``zero_quantized_gradients_bits``, 4 by default, one fp32 scale per ``zero_quantized_block_size``
elements; zeroshard/quantize/blocks.py), and each rank dequantises what it receives and sums it in fp32:
it then holds its node's sum of the M chunks owned by ranks of local index l.  Hop two, across nodes:
each rank re-quantises the sums for the other nodes' owners and sends each to the rank of the same local
index there, which dequantises and sums the M node sums into its chunk.  So each value is quantised at
most twice on its way, never once per ring step as a ring of quantised partial sums would be, and only
the second hop crosses the network: ``(M - 1)`` chunks of S elements at ``bits / 8`` bytes each plus
their scales per rank and bucket.  Within one node (M = 1) the first hop is the whole reduction.  What
a rank contributes to its own chunk never leaves it and is never quantised: the own part of stage 2's
accumulated chunk (``own``) keeps the earlier micro steps' sums exact, and the error of a step's
gradient is the dequantisation error of the other ranks' parts.  Nodes of unequal sizes, or ranks of a
node not consecutive, reduce in one hop over the whole group.

The two hops and the arithmetic between them run on a progress thread of their own, as a ring does
([Note: rings progress on their own thread] in distributed/ring_progress.py): a rank blocked in a hop
would otherwise wait for a peer whose training thread is in a stage-3 gather round that waits for it.
Their bytes are counted when the bucket is launched, on the training thread, so the ledger's order is
the launch order on every rank.  Experts' buckets are sharded over the ranks holding the same experts
([Note: experts sharded over the ranks that hold them] in experts/groups.py), so they reduce the same way
over that group, cut into its nodes as the shard group is (its own two groups, ``expert_grads_*``): where
each of its ranks is on a node of its own (expert-parallel blocks of a whole node) only the hop across
nodes runs.  A group of one rank has nothing to reduce.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import ZeroConfig
from ..distributed.collectives import Collectives, PendingCollective
from ..distributed.topology import ShardGroups
from ..quantize import BlockFormat, pack, packed_bytes, unpack

__all__ = ["QuantisedReduction", "quantised_reduction"]


@dataclass(frozen=True)
class QuantisedReduction:
    """qgZ over a shard group cut into nodes: ``inside`` (this rank's node, its L ranks) and ``across`` (the
    ranks of the same local index on the M nodes; None on one node); see [Note: gradients reduced in two
    quantised hops]."""

    inside: Collectives
    across: Optional[Collectives]
    format: BlockFormat

    @property
    def local(self) -> int:
        return self.inside.world.world_size

    @property
    def nodes(self) -> int:
        return self.across.world.world_size if self.across is not None else 1

    def hop_bytes(self, shard_numel: int) -> tuple[int, int]:
        """Bytes each rank's input of the two hops holds (inside, across) for a bucket of ``shard_numel``
        elements per chunk; a rank sends all but its own part of each."""
        inside = self.local * packed_bytes(self.nodes * shard_numel, self.format) if self.local > 1 else 0
        across = self.nodes * packed_bytes(shard_numel, self.format) if self.nodes > 1 else 0
        return inside, across

    def buffer_bytes(self, shard_numel: int) -> int:
        """What one reduction holds while it runs: both hops' inputs and outputs, and the fp32 sums."""
        inside, across = self.hop_bytes(shard_numel)
        return 2 * (inside + across) + 4 * self.nodes * shard_numel

    def reduce(self, full: torch.Tensor, output: torch.Tensor, own: Optional[torch.Tensor],
               label: str) -> PendingCollective:
        """Start summing ``full`` (1D, N chunks, already divided) over the shard group into ``output``, this
        rank's chunk; ``own``: this rank's share of its own chunk where it lives outside ``full``."""
        inside, across = self.hop_bytes(output.numel())
        counter = self.inside.count_all_to_all(inside, f"{label}.qgz") if self.local > 1 else None
        if self.across is not None:
            counter = self.across.count_all_to_all(across, f"{label}.qgz")
        assert counter is not None, "qgZ is built for groups of two or more ranks"
        driver = self.inside if self.local > 1 else self.across
        assert driver is not None
        return driver.drive(_TwoHops(self, full, output, own), label, counter)


class _TwoHops:
    """One bucket's reduction, run by a progress thread (its ``wait``)."""

    def __init__(self, plan: QuantisedReduction, full: torch.Tensor, output: torch.Tensor,
                 own: Optional[torch.Tensor]) -> None:
        self.plan, self.full, self.output, self.own = plan, full, output, own

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        with torch.no_grad():
            sums = self._inside()
            node = self.plan.across.world.rank if self.plan.across is not None else 0
            self.output.copy_(self._across(sums, node))
        return True

    def _inside(self) -> torch.Tensor:
        """Hop one: this node's fp32 sums of the chunks owned by ranks of this rank's local index, [M, S]."""
        plan, shard = self.plan, self.output.numel()
        local, nodes, me = plan.local, plan.nodes, plan.inside.world.rank
        rank = (plan.across.world.rank if plan.across is not None else 0) * local + me
        chunks = self.full.view(nodes, local, shard)
        sums = torch.empty(nodes, shard, dtype=torch.float32, device=self.full.device)
        for node in range(nodes):  # this rank's own parts, exact; its own chunk's from ``own`` where given
            sums[node].copy_(self.own if self.own is not None and node == rank // local else chunks[node, me])
        if local == 1:
            return sums
        size = packed_bytes(nodes * shard, plan.format)
        send = torch.empty(local * size, dtype=torch.uint8, device=self.full.device)
        for peer in range(local):
            if peer != me:
                pack(chunks[:, peer, :], plan.format, send[peer * size:(peer + 1) * size])  # M rows, read flat
        received = torch.empty_like(send)
        plan.inside.exchange(received, send)
        for peer in range(local):
            if peer != me:
                unpack(received[peer * size:(peer + 1) * size], nodes * shard, plan.format, sums.view(-1),
                       accumulate=True)
        return sums

    def _across(self, sums: torch.Tensor, node: int) -> torch.Tensor:
        """Hop two: the M node sums of this rank's chunk, summed in fp32."""
        plan, shard = self.plan, self.output.numel()
        if plan.across is None:
            return sums[0]
        size = packed_bytes(shard, plan.format)
        send = torch.empty(plan.nodes * size, dtype=torch.uint8, device=sums.device)
        for other in range(plan.nodes):
            if other != node:
                pack(sums[other], plan.format, send[other * size:(other + 1) * size])
        received = torch.empty_like(send)
        plan.across.exchange(received, send)
        total = sums[node]  # summed in place: the other nodes' sums were packed above
        for other in range(plan.nodes):
            if other != node:
                unpack(received[other * size:(other + 1) * size], shard, plan.format, total, accumulate=True)
        return total


def quantised_reduction(groups: ShardGroups, zero: ZeroConfig, experts: bool = False) -> Optional[QuantisedReduction]:
    """The qgZ reduction the config asks for over ``groups``' qgZ groups (None: off, or nothing to reduce);
    ``experts``: the one of the experts' buckets, over the ranks holding the same experts."""
    inside = groups.expert_grads_inside_node if experts else groups.grads_inside_node
    across = groups.expert_grads_across_nodes if experts else groups.grads_across_nodes
    if not zero.zero_quantized_gradients or inside is None:
        return None
    fmt = BlockFormat(zero.zero_quantized_gradients_bits, zero.zero_quantized_block_size)
    return QuantisedReduction(inside, across, fmt)
