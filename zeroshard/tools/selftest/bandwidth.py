"""Collective bandwidth: all-gather and reduce-scatter through zeroshard's own collectives (the calls
its stages make), over the whole world and, when the world spans nodes, inside each node.

For a message of ``B`` bytes (the full, gathered tensor) taking ``t`` seconds (the median of ``reps``
after a warm-up, the slowest rank's), the algorithm bandwidth is ``B / t`` and the bus bandwidth
``B / t * (N - 1) / N``: what each rank's link carried (see [Note: byte model] in
distributed/collectives.py), comparable across world sizes and with nccl-tests' ``busbw``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ...distributed.collectives import Collectives
from ...distributed.world import World
from .ranks import reduce_values, settle

MIB = 2**20
SIZES = {"cpu": (1 * MIB, 8 * MIB), "cuda": (8 * MIB, 64 * MIB, 512 * MIB)}
REPS = {"cpu": 3, "cuda": 10}


def node_world(world: World) -> Optional[World]:
    """This rank's node as a world of its own (torchrun's ``LOCAL_WORLD_SIZE`` ranks per node), or None
    when the world is one node.  Every rank creates every node's group, as ``new_group`` requires."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size))
    if per_node >= world.world_size or world.world_size % per_node:
        return None
    mine = None
    for first in range(0, world.world_size, per_node):
        group = dist.new_group(list(range(first, first + per_node)))
        if first <= world.rank < first + per_node:
            mine = group
    return dataclasses.replace(world, rank=world.rank % per_node, world_size=per_node, group=mine,
                               spans_nodes=False)


def _time(world: World, operation: Callable[[], Any], reps: int) -> float:
    times = []
    for i in range(reps + 1):
        settle(world)
        started = time.perf_counter()
        operation()
        if world.device.type == "cuda":
            torch.cuda.synchronize(world.device)
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(world: World, scope: str, sizes: Sequence[int], reps: int, timing_world: World) -> list[dict[str, Any]]:
    """Each size's all-gather and reduce-scatter over ``world``; ``timing_world`` (the whole job) agrees
    on the slowest rank's time, so that every rank takes part in every agreement."""
    comm = Collectives(world)
    n = world.world_size
    rows = []
    for size in sizes:
        elements = size // 4 // n * n
        full = torch.ones(elements, device=world.device)
        shard = torch.ones(elements // n, device=world.device)
        for kind, operation in (("all_gather", lambda: comm.all_gather(full, shard, "selftest")),
                                ("reduce_scatter", lambda: comm.reduce_scatter(shard, full, "selftest"))):
            seconds = reduce_values(timing_world, [_time(world, operation, reps)], "max")[0]
            rows.append({"scope": scope, "op": kind, "ranks": n, "bytes": elements * 4, "seconds": seconds,
                         "algbw_gb_s": elements * 4 / seconds / 1e9,
                         "busbw_gb_s": elements * 4 / seconds / 1e9 * (n - 1) / n})
    return rows


def run_all(world: World, say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The world's bandwidth at a few sizes, and each node's when there are several (none for one rank)."""
    if not world.is_distributed:
        say("selftest: collectives: a world of one rank moves nothing; not measured")
        return []
    sizes, reps = SIZES[world.device.type], REPS[world.device.type]
    rows = measure(world, "world", sizes, reps, world)
    node = node_world(world)
    if node is not None and node.world_size > 1:
        rows += measure(node, "node", sizes, reps, world)
    for row in rows:
        say(f"selftest: {row['scope']} {row['op']} {row['bytes'] / MIB:g} MiB: {row['busbw_gb_s']:.2f} GB/s bus")
    return rows
