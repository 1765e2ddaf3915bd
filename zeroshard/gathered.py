"""Reading and changing sharded parameters outside forward: ``zeroshard.GatheredParameters``.

    with zeroshard.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if rank == 0:
            model.lm_head.weight.normal_(0, 0.02)   # rank 0's values are written into every shard

Every rank must enter the block with the same parameters (it issues collectives).  Inside, the full
values are present; on exit, with ``modifier_rank=r``, rank r's values are broadcast and each rank
keeps its own chunk of them; then the parameters are released again.  Parameters that zeroshard does
not shard (stages 0-2, persistent ones) are simply available; with a modifier rank their values are
still broadcast, so that every rank ends with rank r's.  Frozen parameters are not managed by
zeroshard: with a modifier rank they are refused (change them on every rank instead).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch
from torch import nn


def _home(p: torch.Tensor) -> Any:
    return getattr(p, "_zeroshard_home", None)


class GatheredParameters:
    """Context manager: full values of (possibly sharded) parameters inside the block."""

    def __init__(self, params: Union[nn.Parameter, Iterable[nn.Parameter]], modifier_rank: Optional[int] = None,
                 enabled: bool = True) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        homes: dict[tuple[int, int], tuple[Any, int]] = {}
        for p in self.params:
            home = _home(p)
            if home is not None:
                storage, index = home
                homes[(id(storage), index)] = (storage, index)
        self._buckets = [homes[k] for k in sorted(homes, key=lambda k: k[1])]
        if modifier_rank is not None and any(_home(p) is None for p in self.params):
            raise ValueError("GatheredParameters(modifier_rank=...) got a parameter zeroshard does not manage "
                             "(frozen, or not part of an initialized engine); modify it on every rank instead")

    def __enter__(self) -> "GatheredParameters":
        if self.enabled:
            for storage, index in self._buckets:
                storage.pin(index, f"gathered_parameters{index}")
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        if self.modifier_rank is not None and exc[0] is None:
            self._write_back(self.modifier_rank)
        for storage, index in self._buckets:
            storage.unpin(index)

    def _write_back(self, src: int) -> None:
        with torch.no_grad():
            for storage, index in self._buckets:
                storage.comm.broadcast(storage.full[index], src, f"gathered_parameters_modify{index}")
                storage.commit_full(index)
