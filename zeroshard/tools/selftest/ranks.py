"""Small agreements between the ranks of the self-test: sums and maxima of a few numbers, a barrier,
and waiting for the device, each on the tensors the world's backend takes (CUDA tensors for NCCL)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ...distributed.world import World


def reduce_values(world: World, values: Sequence[float], op: str = "sum") -> list[float]:
    """``values`` summed (``op="sum"``) or maximised (``"max"``) over the ranks, element by element."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=world.device)
    if world.is_distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=world.group)
    return [float(v) for v in tensor.cpu()]


def settle(world: World) -> None:
    """Every rank here, with its device's queued work done (the start or end of a timed region)."""
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)
    if world.is_distributed:
        dist.barrier(group=world.group)
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)
