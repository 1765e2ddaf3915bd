"""``deepspeed.module_inject.tp_shard``: AutoTP's per-rank shard sizes (tensor_parallel/shard_sizes.py)
under DeepSpeed's names."""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from ...tensor_parallel.shard_sizes import AutoTPMeta, shard_size, shard_size_list

__all__ = ["AutoTPMeta", "get_shard_size", "get_shard_size_list"]


def _meta_and_name(meta: Any, name: Optional[str]) -> tuple[Optional[AutoTPMeta], Optional[str]]:
    """DeepSpeed before its ``AutoTPMeta`` took the layer's name where the metadata now goes."""
    if meta is None or isinstance(meta, AutoTPMeta):
        return meta, name
    return None, str(meta)


def get_shard_size(total_size: int, mp_size: int, meta: Any = None, name: Optional[str] = None,
                   rank: Optional[int] = None, mp_group: Any = None) -> int:
    """Rank ``rank``'s share (this process's rank in ``mp_group``, or in the world, when not given)."""
    if rank is None:
        rank = dist.get_rank(group=mp_group) if mp_group is not None else dist.get_rank()
    return shard_size(total_size, mp_size, *_meta_and_name(meta, name), rank)


def get_shard_size_list(total_size: int, mp_size: int, meta: Any = None, name: Optional[str] = None) -> list[int]:
    """Every rank's share."""
    return shard_size_list(total_size, mp_size, *_meta_and_name(meta, name))
