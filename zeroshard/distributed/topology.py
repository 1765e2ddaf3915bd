"""Which node each rank is on, and the process groups of hybrid sharding (MiCS, hpZ).

[Note: hybrid sharding groups]
Plain ZeRO shards over all N ranks, so on several nodes every parameter gather and gradient
reduce-scatter crosses the network.  Hybrid sharding keeps the frequent collectives inside a group
of S ranks, which torchrun's numbering puts on one node (the ranks of a node are consecutive):

- ``mics_shard_size: S`` (MiCS, FSDP2's HSDP): the state is sharded over *shard groups* of S
  consecutive ranks and replicated across the N/S groups.  Gathers and reduce-scatters stay inside the
  shard group; once per optimizer step each rank all-reduces its gradient shard with the ranks that
  hold the same shard in the other groups (its *replica group*).
- ``zero_hpz_partition_size: S`` (ZeRO++ hpZ, stage 3): the primary partition stays over all N ranks;
  the first gather after each step also keeps a *secondary* partition of the parameters over the S
  consecutive ranks of the node, and every later gather until the next step gathers from it, inside
  the group.

Groups are consecutive blocks of S ranks, cut by the job's axes (:meth:`ParallelDims.positions`, see
[Note: the order of the axes] in distributed/parallel_dims.py): they follow node boundaries when S
divides the ranks per node (or the reverse).  A size that does not divide the world is refused when the
axes are built (``ParallelDims.for_job``).  Every rank creates every group, in the same order, as
``new_group`` requires.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from .collectives import Collectives, CommLedger
from .parallel_dims import ParallelDims
from .world import World, new_side_group


def node_id() -> str:
    """This process's node: torchrun's node rank (``GROUP_RANK``) when launched by it, else the host name."""
    group_rank = os.environ.get("GROUP_RANK")
    return f"node{group_rank}" if group_rank is not None else socket.gethostname()


@dataclass(frozen=True)
class Topology:
    """The node of every rank, in rank order."""

    node_of: tuple[str, ...]

    @classmethod
    def discover(cls, world: World) -> "Topology":
        """Every rank's :func:`node_id` (one small all-gather at set-up)."""
        if not world.is_distributed:
            return cls((node_id(),))
        found: list[Optional[str]] = [None] * world.world_size
        dist.all_gather_object(found, node_id(), group=world.group)
        return cls(tuple(str(n) for n in found))

    def spans_nodes(self, ranks: Iterable[int]) -> bool:
        return len({self.node_of[r] for r in ranks}) > 1

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of))


@dataclass
class ShardGroups:
    """The groups one engine's sharding communicates over (see [Note: hybrid sharding groups]).

    ``shard`` is the group the training state is sharded over (the whole world without MiCS);
    ``replicas`` (MiCS) the ranks holding the same shard in the other shard groups; ``secondary``
    (hpZ) the group of the secondary parameter partition; ``job`` every rank (gradients are averaged
    over all of them).
    """

    shard: Collectives
    #: every rank of the job (the engine's own collectives)
    job: Collectives
    replicas: Optional[Collectives] = None
    secondary: Optional[Collectives] = None
    #: stage 3: the shard group's ranks again, for the gradient reduce-scatters alone, and a gloo group
    #: of every rank for the gather rounds (see [Note: ranks agree on every gather] in
    #: sharding/stage3/gather_agreement.py)
    grads: Optional[Collectives] = None
    rounds: Optional[Collectives] = None
    #: expert parallelism (see [Note: experts sharded over the ranks that hold them] in
    #: experts/groups.py): the ranks that exchange tokens (``expert_parallel``, blocks of consecutive
    #: ranks) and the ranks holding the same experts, which experts' buckets are sharded over
    #: (``expert_data``, the same position in every block)
    expert_parallel: Optional[Collectives] = None
    expert_data: Optional[Collectives] = None
    #: stage 3: the expert-data-parallel ranks again, for the experts' gradient reduce-scatters alone
    expert_grads: Optional[Collectives] = None
    #: sequence parallelism: the ranks that split each sequence (blocks of ``sp`` consecutive ranks)
    sequence: Optional[Collectives] = None
    #: ZeRO++'s qgZ: the shard group's ranks on this rank's node, and the ranks of the same local index on
    #: every node (None on one node), for the gradients' two all-to-alls alone (see [Note: gradients
    #: reduced in two quantised hops] in sharding/quantised_reduction.py)
    grads_inside_node: Optional[Collectives] = None
    grads_across_nodes: Optional[Collectives] = None
    #: the same two for experts' buckets, cut from the ranks holding the same experts (``expert_data``)
    expert_grads_inside_node: Optional[Collectives] = None
    expert_grads_across_nodes: Optional[Collectives] = None

    @property
    def data_parallel_size(self) -> int:
        return self.job.world.world_size

    def _side(self) -> list[Collectives]:
        return [c for c in (self.shard, self.replicas, self.secondary, self.grads, self.rounds,
                            self.expert_parallel, self.expert_data, self.expert_grads, self.sequence,
                            self.grads_inside_node, self.grads_across_nodes, self.expert_grads_inside_node,
                            self.expert_grads_across_nodes)
                if c is not None and c.world.group is not None]

    def release(self) -> None:
        """Drop the references to the side groups (at exit, before the process groups are destroyed)."""
        for comm in self._side():
            comm.world = dataclasses.replace(comm.world, group=None)

    def close(self) -> None:
        """Destroy the side groups (``engine.close()``)."""
        # never the job's own group: an engine over a group it was given (a pipeline stage's, an mpu's
        # data-parallel group) shards over that group itself, which its owner destroys
        job = self.job.world.group
        groups = [c.world.group for c in self._side() if c.world.group is not job]
        self.release()
        if dist.is_initialized():
            for group in groups:
                dist.destroy_process_group(group)


def _new_group(world: World, ranks: Sequence[int]) -> Optional[dist.ProcessGroup]:
    return new_side_group(world, ranks)


def _own_group(comm: Collectives, topology: Topology, partition: Sequence[Sequence[int]]) -> Collectives:
    """Every group of ``partition`` created, in order, as every rank must; this rank's one."""
    world = comm.world
    mine: Optional[tuple[Optional[dist.ProcessGroup], list[int]]] = None
    for ranks in partition:
        group = _new_group(world, ranks)
        if world.rank in ranks:
            mine = (group, list(ranks))
    assert mine is not None, "the partition covers every rank"
    group, ranks = mine
    return comm.over(dataclasses.replace(world, rank=ranks.index(world.rank), world_size=len(ranks),
                                         group=group, spans_nodes=topology.spans_nodes(ranks)))


def build_shard_groups(comm: Collectives, topology: Topology, axes: ParallelDims,
                       gathers_in_passes: bool = False, quantised_gradients: bool = False) -> ShardGroups:
    """The engine's :class:`ShardGroups` over ``comm``'s world, the ZeRO world of ``axes`` (its ranks
    numbered by position): MiCS's shard and replica groups (``axes.dp_replicate`` > 1), hpZ's secondary
    partitions (``axes.hpz`` > 1), the expert groups (``axes.ep`` > 1) and the sequence groups
    (``axes.sp`` > 1), each from
    :meth:`ParallelDims.positions`.  ``gathers_in_passes`` (stage 3): with the groups its gather rounds
    need; ``quantised_gradients`` (qgZ): with the groups of its two all-to-alls, for the shard group and
    for the experts' groups."""
    n = comm.world.world_size
    if n != axes.zero_size:
        raise ValueError(f"the engine's world has {n} ranks, but the axes {axes.describe()} shard over "
                         f"{axes.zero_size}")
    groups = _sharding_groups(comm, topology, axes)
    if axes.sp > 1:
        groups.sequence = _own_group(comm, topology, axes.positions("sequence"))
    if axes.ep > 1:
        groups.expert_parallel = _own_group(comm, topology, axes.positions("expert"))
        groups.expert_data = _own_group(comm, topology, axes.positions("expert_data"))
        if gathers_in_passes:  # a second copy of the experts' groups, for their gradients alone
            groups.expert_grads = _own_group(comm, topology, axes.positions("expert_data"))
    if quantised_gradients and comm.world.is_distributed and groups.shard.world.world_size > 1:
        inside, across = _agreed_node_partitions(comm, axes.positions("shard"), topology)
        groups.grads_inside_node = _own_group(comm, topology, inside)
        groups.grads_across_nodes = _own_group(comm, topology, across) if across else None
    if quantised_gradients and groups.expert_data is not None and groups.expert_data.world.world_size > 1:
        inside, across = _agreed_node_partitions(comm, axes.positions("expert_data"), topology)
        groups.expert_grads_inside_node = _own_group(comm, topology, inside)
        groups.expert_grads_across_nodes = _own_group(comm, topology, across) if across else None
    if gathers_in_passes and comm.world.is_distributed:
        groups.grads = _own_group(comm, topology, axes.positions("shard"))
        rounds = new_side_group(comm.world, backend="gloo")
        # counted apart: the rounds are bookkeeping, not ZeRO's traffic; launched behind the engine's gate
        # (see [Note: the backward's check runs behind its compute] in distributed/consistency.py)
        groups.rounds = Collectives(dataclasses.replace(comm.world, group=rounds, device=torch.device("cpu"),
                                                        backend="gloo"), CommLedger(comm.ledger.gate))
    return groups


def node_partitions(shard_groups: Sequence[Sequence[int]],
                    topology: Topology) -> tuple[list[list[int]], list[list[int]]]:
    """Each shard group cut into its nodes (blocks of consecutive ranks on one node) and into the ranks of
    the same local index on each node: (inside, across; empty on one node).  A group whose nodes are not
    equal blocks of consecutive ranks is one block, with nothing across (see [Note: gradients reduced in
    two quantised hops] in sharding/quantised_reduction.py)."""
    whole = [list(ranks) for ranks in shard_groups]
    inside: list[list[int]] = []
    across: list[list[int]] = []
    for ranks in shard_groups:
        blocks: list[list[int]] = []
        for rank in ranks:
            if blocks and topology.node_of[blocks[-1][-1]] == topology.node_of[rank]:
                blocks[-1].append(rank)
            else:
                blocks.append([rank])
        even = len({len(b) for b in blocks}) == 1 and len({topology.node_of[b[0]] for b in blocks}) == len(blocks)
        if not even or len(blocks) == 1:  # every group is cut alike: one hop for all
            return whole, []
        inside.extend(blocks)
        across.extend([block[local] for block in blocks] for local in range(len(blocks[0])))
    return inside, across


def _agreed_node_partitions(comm: Collectives, groups: Sequence[Sequence[int]],
                            topology: Topology) -> tuple[list[list[int]], list[list[int]]]:
    """:func:`node_partitions` of ``groups``, the same in every part of a partial world: a part's groups are
    created by every rank with the same positions in each part ([Note: side groups of a partial world] in
    distributed/world.py), so where the parts' nodes are not cut alike (a pipeline stage inside a node
    beside one across two) every part reduces in one hop.  Every rank of the job enters it, at the same
    point of its engine's construction, as it does ``dist.new_group``."""
    inside, across = node_partitions(groups, topology)
    if not comm.world.parts:
        return inside, across
    cuts: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(cuts, (inside, across))
    return (inside, across) if all(cut == cuts[0] for cut in cuts) else ([list(g) for g in groups], [])


def _sharding_groups(comm: Collectives, topology: Topology, axes: ParallelDims) -> ShardGroups:
    if axes.dp_replicate > 1:
        shard = _own_group(comm, topology, axes.positions("shard"))
        return ShardGroups(shard, comm, replicas=_own_group(comm, topology, axes.positions("replicate")))
    if 1 < axes.hpz < axes.zero_size:
        return ShardGroups(comm, comm, secondary=_own_group(comm, topology, axes.positions("secondary")))
    return ShardGroups(comm, comm)
