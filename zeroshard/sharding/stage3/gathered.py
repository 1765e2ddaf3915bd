"""Reading and changing sharded parameters outside forward: ``zeroshard.GatheredParameters``.

    with zeroshard.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if rank == 0:
            model.lm_head.weight.normal_(0, 0.02)   # rank 0's values are written into every shard

Every rank must enter the block with the same parameters (it issues collectives).  Inside, the full
values are present; on exit, with ``modifier_rank=r``, rank r's values are broadcast and each rank
keeps its own chunk of them; then the parameters are released again.  Three kinds of parameters
can be named, also mixed in one call:

- parameters of an initialized stage-3 engine (their buckets are pinned gathered);
- parameters built under ``zeroshard.Init`` before ``initialize()`` (each is gathered on its own:
  the pattern of a module that initialises a weight in its ``__init__`` on one rank);
- anything else (stages 0-2, persistent or frozen parameters, a plain module): simply available;
  with a modifier rank their values are still broadcast, so that every rank ends with rank r's.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from ...distributed.collectives import Collectives
from ...distributed.world import init_distributed
from .init_param import InitShardedParameter
from ..storage import HOMES, ParameterStorage


def _home(p: torch.Tensor) -> Optional[tuple[ParameterStorage, int]]:
    home = HOMES.home_of(p)
    return None if home is None else (home.storage, home.bucket)


class GatheredParameters:
    """Context manager: full values of (possibly sharded) parameters inside the block."""

    def __init__(self, params: Union[nn.Parameter, Iterable[nn.Parameter], None],
                 modifier_rank: Optional[int] = None, fwd_module: Optional[nn.Module] = None,
                 enabled: bool = True) -> None:
        if params is None:
            params = []
        given = [params] if isinstance(params, torch.Tensor) else list(params)
        self.params = [p for p in given if p is not None]  # e.g. a Linear's absent bias
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        homes: dict[tuple[int, int], tuple[ParameterStorage, int]] = {}
        for p in self.params:
            home = _home(p)
            if home is not None:
                storage, index = home
                homes[(id(storage), index)] = (storage, index)
        self._buckets = [homes[k] for k in sorted(homes, key=lambda k: k[1])]
        self._init_params = list({id(p.root()): p.root() for p in self.params
                                  if isinstance(p, InitShardedParameter)}.values())
        self._plain = [p for p in self.params if _home(p) is None and not isinstance(p, InitShardedParameter)]

    def __enter__(self) -> "GatheredParameters":
        if self.enabled and self.modifier_rank is not None:
            for storage in {id(s): s for s, _ in self._buckets}.values():
                storage.copy_gate.wait_for_copies()  # the block may write what an asynchronous save copies
        if self.enabled:
            for storage, index in self._buckets:
                storage.pin(index, f"gathered_parameters{index}")
            for p in self._init_params:
                p.materialize()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        modify = self.modifier_rank is not None and exc[0] is None
        if modify:
            self._write_back(self.modifier_rank)
        for p in self._init_params:
            p.dematerialize(self.modifier_rank if modify else None)
        for storage, index in self._buckets:
            storage.unpin(index)

    def _write_back(self, src: Any) -> None:
        with torch.no_grad():
            for storage, index in self._buckets:
                storage.job_comm.broadcast(storage.full[index], src, f"gathered_parameters_modify{index}")
                storage.commit_full(index)
            if self._plain:
                comm = Collectives(init_distributed())
                if comm.world.is_distributed:
                    for p in self._plain:
                        comm.broadcast(p.data, src, "gathered_parameters_modify_plain")
