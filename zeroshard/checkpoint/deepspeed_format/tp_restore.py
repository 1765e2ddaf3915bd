"""A universal checkpoint's whole parameter cut back to one tensor-parallel rank's slice, for DeepSpeed's
``load_hp_checkpoint_state`` (its optimizers' universal load, one parameter at a time).

[Note: cutting a universal parameter for a rank]
A parameter that AutoTP split carries its restore description as an attribute
(``ds_autotp_universal_checkpoint_meta``: ``partition_dim``, ``logical_shape``, and for an uneven or
fused split ``partition_sizes``, ``sub_param_sizes`` and ``sub_param_shard_widths``).  It decides the
slice: a replicated parameter is taken whole; a fused one piece by piece with the widths the join used
(tp_layout.py); an unevenly split one by its ``partition_sizes``; an even one in equal blocks.  An
uneven split that records no sizes is refused: ``torch.chunk`` gives the short block to the *last*
ranks while AutoTP gives the extra rows to the first, so a guess would shift rows between ranks.  With
the description present, a universal tensor whose shape equals the rank's is still cut by it (a single
key/value head lives whole on rank 0); without it, equal shapes mean a parameter every rank holds.
Without a description the universal entry's own ``cat_dim``, ``sub_param_shape`` or
``param_n_sub_params`` cut it, as the converter joined it.
"""

from __future__ import annotations

import os
import re
import types
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from ..constants import (CAT_DIM, DS_AUTOTP_UC_META, FP32_WEIGHT_KEY, PARAM, PARAM_N_SUB_PARAMS, SUB_PARAM_SHAPE,
                         UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY, VOCAB_TENSOR)
from ..format import CheckpointError
from .tp_layout import TpLayoutError, even_or_recorded_widths
from .unpickle import load_deepspeed_file

__all__ = ["restore_meta", "autotp_slice", "load_hp_checkpoint_state", "enable_universal_checkpoint",
           "UniversalInfoCache"]


def restore_meta(param: Any) -> Optional[dict[str, Any]]:
    """The restore description AutoTP put on ``param`` (its top-level fields; the converter's own are
    under ``conversion``), or None."""
    return getattr(param, DS_AUTOTP_UC_META, None)


def _fused_slice(full: torch.Tensor, dim: int, sizes: Any, meta: dict[str, Any], tp_rank: int,
                 tp_world_size: int) -> torch.Tensor:
    sizes = tuple(sizes) if isinstance(sizes, (tuple, list)) else (sizes, )
    if sum(sizes) != full.shape[dim]:
        raise TpLayoutError(f"sub-parameter sizes {list(sizes)} sum to {sum(sizes)}, but dimension {dim} of the "
                            f"parameter is {full.shape[dim]}")
    version = float(meta.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0))
    widths = even_or_recorded_widths(sizes, meta.get("sub_param_shard_widths"), tp_world_size, version,
                                     "AutoTP parameter")
    pieces, offset = [], 0
    for size, per_rank in zip(sizes, widths):
        pieces.append(full.narrow(dim, offset + sum(per_rank[:tp_rank]), per_rank[tp_rank]))
        offset += size
    return torch.cat(pieces, dim=dim).flatten()


def autotp_slice(param: Any, full: torch.Tensor, tp_rank: int, tp_world_size: int) -> Optional[torch.Tensor]:
    """Rank ``tp_rank``'s slice of the universal tensor ``full``, flat, by ``param``'s AutoTP description
    (see [Note: cutting a universal parameter for a rank]); None where ``param`` has none."""
    meta = restore_meta(param)
    if not meta:
        return None
    conversion = meta.get("conversion") or {}
    if conversion.get("unsupported_reason"):
        raise CheckpointError(f"Cannot restore a universal checkpoint into this AutoTP parameter: "
                              f"{conversion['unsupported_reason']}")
    if conversion.get("affine_map") is not None:
        raise CheckpointError("AutoTP parameter described by an affine map: not restored by zeroshard")
    dim = meta.get("partition_dim")
    if meta.get("replicated", False):
        return full.flatten()
    if dim is None or meta.get("logical_shape") is None:
        return None
    view = full.view(tuple(meta["logical_shape"]))
    sizes = meta.get("sub_param_sizes")
    if sizes is None and meta.get("sub_param_shape") is not None:
        described = meta["sub_param_shape"]
        spec = getattr(described, "shape", described)
        dim = getattr(described, "partition_dim", dim)
        sizes = spec[dim]
    if sizes is not None:
        return _fused_slice(view, dim, sizes, meta, tp_rank, tp_world_size)
    partition_sizes = meta.get("partition_sizes")
    if partition_sizes is not None:
        return view.narrow(dim, sum(partition_sizes[:tp_rank]), partition_sizes[tp_rank]).flatten()
    if view.shape[dim] % tp_world_size:
        raise TpLayoutError(f"Dimension {dim} of size {view.shape[dim]} is not divisible by tp_world_size "
                            f"{tp_world_size}, and this checkpoint records no partition_sizes, so its uneven "
                            f"layout cannot be rebuilt")
    return view.chunk(tp_world_size, dim=dim)[tp_rank].flatten()


def _entry_slice(entry: dict[str, Any], full: torch.Tensor, tp_rank: int, tp_world_size: int) -> torch.Tensor:
    """The slice by the universal entry's own join description (no AutoTP description on the parameter)."""
    described = entry.get(SUB_PARAM_SHAPE)
    dim = entry.get(CAT_DIM, 0)
    if described:
        dim = described.partition_dim
        sizes = described.shape[dim]
        sizes = sizes if isinstance(sizes, tuple) else (sizes, )
        full = full.view([sum(d) if isinstance(d, tuple) else d for d in described.shape])
        pieces, offset = [], 0
        for size in sizes:
            pieces.append(full.narrow(dim, offset, size).chunk(tp_world_size, dim=dim)[tp_rank])
            offset += size
        return torch.cat(pieces, dim=dim).flatten()
    count = entry.get(PARAM_N_SUB_PARAMS, 1)
    if count > 1:
        return torch.cat([p.chunk(tp_world_size, dim=dim)[tp_rank] for p in full.chunk(count, dim=dim)],
                         dim=dim).flatten()
    return full.chunk(tp_world_size, dim)[tp_rank].flatten()


def _experts_of_rank(param: Any, entry: dict[str, Any], full: torch.Tensor, ep_rank: int, ep_size: int,
                     folder: str) -> torch.Tensor:
    """An expert parameter's experts of expert-parallel rank ``ep_rank`` (stacked on dim 0, an equal number
    per rank); every other parameter as it is."""
    if not entry.get("is_expert_param", False) or ep_size == 1:
        return full
    if getattr(param, "ds_autoep_uc_meta", None) is not None:
        raise CheckpointError(f"{folder}: AutoEP's expert placement is not restored by zeroshard")
    experts = entry.get("ep_num_experts")
    if experts is None or full.shape[0] != experts or experts % ep_size:
        raise TpLayoutError(f"{folder}: expert parameter of {full.shape[0]} rows, ep_num_experts {experts}, cannot "
                            f"be split over {ep_size} expert-parallel ranks")
    local = experts // ep_size
    return full[ep_rank * local:(ep_rank + 1) * local]


def _state_keys(folder: str) -> Iterable[str]:
    for file in os.listdir(folder):
        match = re.fullmatch(r"(.+)\.pt", file)
        if match:
            yield match.group(1)


def load_hp_checkpoint_state(self: Any, folder: str, tp_rank: int, tp_world_size: int, ep_rank: int = 0,
                             ep_size: int = 1) -> Any:
    """DeepSpeed's per-parameter universal load, bound to a parameter with a ``_hp_mapping``: each state
    file of ``folder`` cut to this rank's slice and to the parameter's fragment of it; ``fp32`` into the
    master fragment, the moments into ``optim_fragment``.  Returns the saved step (``step.pt``) or None."""
    mapping = self._hp_mapping
    mapping.optim_fragment = {}
    step = None
    for key in _state_keys(folder):
        entry = load_deepspeed_file(Path(folder) / f"{key}.pt")  # read as data, never run
        if key == "step":
            step = entry
            continue
        full = _experts_of_rank(self, entry, entry[PARAM], ep_rank, ep_size, folder)
        described = restore_meta(self) is not None
        # a universal tensor of the rank's own shape is one every rank holds whole, unless AutoTP
        # described how it was cut (see [Note: cutting a universal parameter for a rank])
        rank, world = (0, 1) if full.shape == self.shape and not described else (tp_rank, tp_world_size)
        if entry.get(VOCAB_TENSOR, False) and not described:
            padded = self.shape[0] * world
            if padded < full.shape[0]:
                raise TpLayoutError(f"{folder}: vocabulary of {full.shape[0]} rows exceeds the target's {padded}")
            full = torch.nn.functional.pad(full, (0, 0, 0, padded - full.shape[0]))
        piece = autotp_slice(self, full, rank, world)
        if piece is None:
            if full.numel() != world * self.numel():
                raise TpLayoutError(f"{folder}/{key}.pt: {full.numel()} elements, not {world} x {self.numel()}")
            piece = _entry_slice(entry, full, rank, world)
        address = mapping.lp_fragment_address
        fragment = piece.narrow(0, address.start, address.numel)
        if key == FP32_WEIGHT_KEY:
            mapping.get_hp_fragment().data.copy_(fragment.data)
        else:
            mapping.optim_fragment[key] = fragment.clone().detach()
    return step


def enable_universal_checkpoint(param_list: Iterable[Any]) -> None:
    """Give each parameter of ``param_list`` its ``load_hp_checkpoint_state`` method."""
    for param in param_list:
        param.load_hp_checkpoint_state = types.MethodType(load_hp_checkpoint_state, param)


class UniversalInfoCache:
    """What DeepSpeed's ZeRO 1-2 and bf16 optimizers do for universal checkpoints at construction: the
    first ``universal_checkpoint_info`` found on a parameter of their groups (named by ``GROUPS``) is kept,
    as the parameters may lose it later, and every parameter gets ``load_hp_checkpoint_state``."""

    GROUPS = "bit16_groups"

    def _enable_universal_checkpoint(self) -> None:
        self._universal_checkpoint_info: Optional[Any] = None
        for group in getattr(self, self.GROUPS):
            if self._universal_checkpoint_info is None:
                self._universal_checkpoint_info = next(
                    (info for info in (getattr(p, UNIVERSAL_CHECKPOINT_INFO, None) for p in group) if info is not None),
                    None)
            enable_universal_checkpoint(group)

    def _get_universal_checkpoint_info(self) -> Optional[Any]:
        return getattr(self, "_universal_checkpoint_info", None)
