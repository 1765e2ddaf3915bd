"""``zeroshard.deepspeed.runtime.utils``: ``set_random_seed``, ``see_memory_usage``, ``partition_balanced``,
``move_to_device``."""

from __future__ import annotations

import gc
import resource
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ...logging import log_rank
from ...pipeline.partition import balanced_bounds
from ..utils import set_random_seed

__all__ = ["set_random_seed", "see_memory_usage", "partition_balanced", "move_to_device"]

GIB = 1024 ** 3


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log ``message`` with this process's memory on rank 0 (only with ``force``, as DeepSpeed): the CUDA
    device's allocated and reserved bytes and their peaks (whose counters are reset), and the host's peak
    resident set."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    line = message
    if torch.cuda.is_available():
        line += (f" | device allocated {torch.cuda.memory_allocated() / GIB:.2f} GB (peak "
                 f"{torch.cuda.max_memory_allocated() / GIB:.2f}), reserved {torch.cuda.memory_reserved() / GIB:.2f} GB "
                 f"(peak {torch.cuda.max_memory_reserved() / GIB:.2f})")
        torch.cuda.reset_peak_memory_stats()
    line += f" | host peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2:.2f} GB"
    log_rank(line)


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """``num_parts + 1`` boundaries cutting ``weights`` into consecutive parts whose heaviest is as light
    as possible (the pipeline's own ``partition_method="parameters"`` split)."""
    return balanced_bounds(list(weights), num_parts)


def move_to_device(item: Any, device: Any, criterion_func: Optional[Callable[[Any], bool]] = None) -> Any:
    """``item`` with every tensor in it (through lists, tuples and dicts) moved to ``device``; with
    ``criterion_func``, only the tensors it accepts (DeepSpeed's signature)."""
    if torch.is_tensor(item):
        return item.to(device) if criterion_func is None or criterion_func(item) else item
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item
