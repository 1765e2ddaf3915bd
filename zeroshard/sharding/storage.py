"""The parameter storage's declared interface, and the one registry of which parameter lives where.

Stages 0-2 keep every bucket whole in one flat buffer (:class:`~.flat_params.FlatParameters`); stage 3
keeps only this rank's chunk of each and gathers a bucket on demand
(:class:`~.stage3.sharded_params.ShardedParameters`).  Everything above the storage (the strategies,
``GatheredParameters``, full state dicts, checkpoints) talks to it through :class:`ParameterStorage`.

[Note: the parameter registry]
``GatheredParameters(model.lm_head.weight)`` is handed a bare parameter and must find the storage
and bucket that hold it.  Rather than hiding attributes on the user's tensors, each storage records
its parameters (and stage 3's placeholders for them) in :data:`HOMES`, keyed by tensor identity and
held weakly, and removes them when it is closed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional, Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..distributed.collectives import Collectives
from ..host.buffer_memory import BufferMemory
from ..offload.policy import SwapFailure
from .layout import BucketLayout, FlatLayout
from .master_weights import MasterWeights


class CopyGate(Protocol):
    """What copies a storage's state outside training (an asynchronous save: see [Note: asynchronous
    saves] in checkpoint/background.py), as the engine hands it to the storage it builds."""

    def copying(self) -> bool:
        """Whether a copy of the state is under way now."""

    def wait_for_copies(self) -> None:
        """Block until no copy is under way (before the state is written)."""


class NoCopies:
    """The gate of a storage nothing copies outside training (one no engine saves)."""

    def copying(self) -> bool:
        return False

    def wait_for_copies(self) -> None:
        """Nothing to wait for."""


class ParameterStorage(Protocol):
    """Where the trainable parameters' values live, bucket by bucket."""

    layout: FlatLayout
    comm: Collectives  # the group the buckets are sharded over (a MiCS group, or the whole job)
    job_comm: Collectives  # every rank of the job
    params: list[torch.nn.Parameter]  # what the buckets' slots index: trainable, then (stage 3) frozen
    dtype: torch.dtype  # the compute dtype of the parameters
    device: torch.device  # the training device
    masters: Optional[MasterWeights]  # fp32 masters of the owned chunks, if any
    #: how buffers kept for the run give back their memory and get it again, chosen once by the engine
    #: ([Note: one buffer memory per engine] in host/buffer_memory.py)
    buffer_memory: BufferMemory
    #: what copies the state outside training, given by the engine (:meth:`set_copy_gate`); whatever
    #: writes the parameters from outside training waits on it first (``GatheredParameters``)
    copy_gate: CopyGate

    @property
    def full(self) -> list[torch.Tensor]:
        """Per bucket, its full 1D padded buffer (stage 3: only meaningful while gathered)."""

    def bucket_view(self, bucket: BucketLayout) -> torch.Tensor: ...

    def shard_view(self, bucket: BucketLayout, rank: int) -> torch.Tensor:
        """``rank``'s chunk of ``bucket`` (stage 3 holds only its own)."""

    def gather(self, index: int, label: str, async_op: bool = False) -> None:
        """Make bucket ``index``'s full values present (a collective at stage 3; else nothing)."""

    def release(self, index: int) -> None:
        """Free bucket ``index``'s full values again (stage 3)."""

    def pin(self, index: int, label: str) -> None:
        """Gather and keep until :meth:`unpin` (``GatheredParameters``)."""

    def unpin(self, index: int) -> None: ...

    def take_back_chunks(self) -> None:
        """Stage 3: every chunk lent to a gathered unit back in the store (see [Note: a gathered unit
        borrows this rank's chunk] in sharding/stage3/sharded_params.py), before the chunks are read or
        written as a whole (the optimizer step, a save or a load).  Nothing to do at stages 0-2."""

    def set_copy_gate(self, gate: CopyGate) -> None:
        """``gate`` copies the state outside training from now on (stage 3 lends no chunk while it copies)."""

    def commit_full(self, index: int) -> None:
        """The full bucket was modified in place: the owned chunk (and the masters) follow it."""

    def write_own_chunk(self, index: int, chunk: torch.Tensor) -> None:
        """Replace this rank's chunk of a frozen bucket (stage 3 only has those)."""

    def take_failure(self) -> SwapFailure:
        """A swap failure to raise on every rank (NVMe parameter offload), once."""

    def detach_parameters(self) -> None:
        """Give every parameter its own full, current values and forget it (``Engine.close()``)."""

    def close(self) -> None:
        """Release files and threads (NVMe); idempotent."""


@dataclass(frozen=True)
class ParamHome:
    """Where one trainable parameter lives: its storage, bucket, name and compute device."""

    storage: ParameterStorage
    bucket: int
    name: str
    device: torch.device


class ParameterRegistry:
    """Parameter (or placeholder) -> :class:`ParamHome`, weakly held (see [Note: the parameter registry])."""

    def __init__(self) -> None:
        self._homes: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def add(self, tensor: torch.Tensor, home: ParamHome) -> None:
        self._homes[tensor] = home

    def home_of(self, tensor: torch.Tensor) -> Optional[ParamHome]:
        return self._homes.get(tensor)

    def forget(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            self._homes.pop(tensor, None)


#: the process's registry: every storage records its parameters here
HOMES = ParameterRegistry()


@dataclass(frozen=True)
class InitialValues:
    """Full values for parameters that have none yet (built under ``zeroshard.Init``): ``id(param)``
    -> a function that gathers them (a collective: every rank calls it in order)."""

    by_id: Mapping[int, Callable[[], torch.Tensor]] = field(default_factory=dict)

    def of(self, param: torch.Tensor) -> torch.Tensor:
        source = self.by_id.get(id(param))
        return param.data if source is None else source()
