"""One trainable parameter's part of its engine's state, for DeepSpeed's tensor-fragment functions
(:mod:`zeroshard.deepspeed.utils.tensor_fragment`).

[Note: a parameter's fragment]
DeepSpeed's fragment functions are handed a bare parameter.  Its home (storage, bucket, slot) is in
the parameter registry ([Note: the parameter registry] in sharding/storage.py), a stage-3 placeholder
included, and its engine is the live engine whose storage that is, so nothing is set on the user's
tensor.  This rank's optimizer owns a range of every bucket (the whole bucket at stage 0, its equal
chunk at stages 1-3: [Note: per-bucket sharding] in sharding/layout.py); the parameter's *fragment*
is where that range meets its slot: one contiguous run of the flattened parameter, possibly empty,
and the ranks' fragments, in rank order, tile it.  The fragment's fp32 values and optimizer state are
read and written through the updater's pieces, wherever they live (the device, host memory, swap
files), and its gradient is the owned gradient the next step reads.  A whole tensor is each rank's
fragment placed in zeros of the parameter's size, summed over the shard group: one all-reduce, exact
because the fragments are disjoint.

[Note: what a fragment write reaches]
The optimizer steps the fp32 masters (or, in fp32 without offload, the parameters themselves), and the
model computes with the parameters.  A new fp32 value therefore goes to both: the fragment's masters,
then the parameter as the model reads it (rounded to its dtype), so that the next forward sees it
without waiting for a step.  Given the whole value (every rank passes the same one), each rank
writes its own full copy at stages 0-2 and, at stage 3, its chunk, plus the full buffer where the
bucket is gathered: no collective.  Given only this rank's fragment, the parameter is gathered again
from the ranks' owned chunks (stages 1-2, and stage 3's persistent buckets): a collective then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from ..checkpoint.background import wait_for_copies
from ..engine.lifetime import ENGINE_OF
from ..offload.policy import Place
from ..optim.host_updater import HostUpdater
from ..optim.updater import Piece
from ..sharding.layout import BucketLayout, ParamSlot
from ..sharding.stage3.sharded_params import GatherState, ShardedParameters
from ..sharding.storage import HOMES

if TYPE_CHECKING:
    from ..engine.engine import Engine


class GradientsUnavailableError(RuntimeError):
    """A gradient was written outside the window where the engine holds one (see :meth:`ParamFragment.grads`)."""


def _live_engines() -> Iterator["Engine"]:
    for ref in list(ENGINE_OF.values()):
        engine = ref()
        if engine is not None:
            yield engine


def _state_tensor(state: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in state:
        raise ValueError(f"optimizer state {key!r} not found: this parameter's optimizer keeps {sorted(state)} "
                         f"per element (none before its first step)")
    return state[key]


@dataclass(frozen=True)
class ParamFragment:
    """Where this rank's fragment of one trainable parameter is (see [Note: a parameter's fragment])."""

    engine: "Engine"
    bucket: BucketLayout
    slot: ParamSlot
    #: [start, end) of what this rank's optimizer owns, relative to the bucket
    owned: tuple[int, int]

    @classmethod
    def of(cls, param: torch.Tensor) -> Optional["ParamFragment"]:
        """The fragment of ``param``; None for a tensor no live engine trains (frozen, or not wrapped)."""
        home = HOMES.home_of(param)
        if home is None:
            return None
        engine = next((e for e in _live_engines() if e.storage is home.storage), None)
        if engine is None:
            return None
        strategy = engine.strategy
        if home.bucket >= len(strategy.layout.buckets):  # stage 3's frozen buckets come after the trainable
            return None
        bucket = strategy.layout.buckets[home.bucket]
        slot = next(s for s in bucket.slots if s.name == home.name)
        # an experts' bucket is sharded over the ranks that hold the same experts, not the whole shard group
        owned = (0, bucket.padded_numel) if strategy.traits.owns_whole_buckets \
            else bucket.shard_range(strategy.ranks.of(bucket))
        return cls(engine, bucket, slot, owned)

    # ------------------------------------------------------------------ where the fragment is
    @property
    def in_param(self) -> tuple[int, int]:
        """[start, end) of the fragment in the flattened parameter (empty where the ranges miss)."""
        start = max(self.slot.offset, self.owned[0])
        end = max(start, min(self.slot.offset + self.slot.numel, self.owned[1]))
        return start - self.slot.offset, end - self.slot.offset

    @property
    def in_owned(self) -> tuple[int, int]:
        """[start, end) of the fragment in this rank's owned chunk of the bucket."""
        start, end = self.in_param
        shift = self.slot.offset - self.owned[0]
        return start + shift, end + shift

    @property
    def numel(self) -> int:
        start, end = self.in_param
        return end - start

    @property
    def device(self) -> torch.device:
        return self.engine.world.device

    def flat_value(self, value: torch.Tensor, local: bool) -> torch.Tensor:
        """``value`` as fp32 on the device, 1D, checked against the whole parameter's or the fragment's size."""
        expected = self.numel if local else self.slot.numel
        if value.numel() != expected:
            what = "this rank's fragment" if local else f"the parameter (shape {self.slot.shape})"
            raise ValueError(f"{self.slot.name}: got {value.numel()} elements, {what} has {expected}")
        return value.detach().reshape(-1).to(device=self.device, dtype=torch.float32)

    def _pieces(self) -> Iterator[tuple[Piece, int, int, int]]:
        """Each optimizer piece holding part of the fragment: (piece, [a, b) in the piece, where it starts
        in the fragment)."""
        start, end = self.in_owned
        for piece in self.engine.updater.pieces[self.bucket.index]:
            a, b = max(start, piece.start), min(end, piece.start + piece.numel)
            if a < b:
                yield piece, a - piece.start, b - piece.start, a - start

    def _settle(self) -> None:
        """No parameter gather in flight, and every chunk a stage-3 unit borrowed back in its store."""
        self.engine.strategy.wait_for_buckets(None)
        self.engine.storage.take_back_chunks()

    # ------------------------------------------------------------------ fp32 values and optimizer state
    def stepped_whole(self, key: str) -> bool:
        """Whether ``key`` is state of a matrix stepped whole on one rank (Muon's momentum: see [Note:
        whole matrices, each on one rank] in optim/whole_matrices.py); a key such an optimizer does not
        keep is refused on every rank."""
        matrices = self.engine.updater.matrices
        if matrices is None or not matrices.covers(self.bucket):
            return False
        if key not in matrices.state_keys(self.bucket):
            raise ValueError(f"optimizer state {key!r} not found: {self.slot.name} is stepped whole, whose "
                             f"optimizer keeps {list(matrices.state_keys(self.bucket))} per element")
        return True

    def read_whole_state(self, key: str) -> torch.Tensor:
        """The whole state ``key`` of a matrix stepped whole, in the parameter's shape, on every rank (a
        collective: it lives on the matrix's owner)."""
        matrices = self.engine.updater.matrices
        assert matrices is not None
        like = torch.zeros(self.slot.numel, dtype=torch.float32, device=self.device)
        return matrices.whole_state(self.bucket, self.slot.index, key, like).view(self.slot.shape)

    def write_whole_state(self, key: str, value: torch.Tensor) -> None:
        matrices = self.engine.updater.matrices
        assert matrices is not None
        matrices.set_whole_state(self.bucket, self.slot.index, key, self.flat_value(value, local=False))

    def read(self, key: Optional[str] = None) -> torch.Tensor:
        """The fragment's fp32 values (``key`` None) or optimizer state ``key``, 1D on the device."""
        self._settle()
        updater, optimizer = self.engine.updater, self.engine.optimizer
        out = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        for piece, a, b, at in self._pieces():
            values, state = updater.read_piece(piece, optimizer.state.get(piece.param, {}), copy=False)
            source = values if key is None else _state_tensor(state, key)
            out[at: at + b - a].copy_(source[a:b])
        return out

    def write(self, values: torch.Tensor, key: Optional[str] = None) -> None:
        """Set the fragment's fp32 values (the masters, or the parameters where they are what the optimizer
        steps) or its optimizer state ``key`` from ``values`` (1D, the fragment's size)."""
        wait_for_copies()  # an asynchronous save may be copying what this changes
        self._settle()
        updater, optimizer = self.engine.updater, self.engine.optimizer
        with torch.no_grad():
            for piece, a, b, at in self._pieces():
                state = optimizer.state.get(piece.param, {})
                current, full = updater.read_piece(piece, state, copy=False)
                target = current if key is None else _state_tensor(full, key)
                target[a:b].copy_(values[at: at + b - a])
                if updater.place is Place.NVME:  # read from its swap files: written back
                    updater.write_piece(piece, current, full)

    def publish(self, whole: Optional[torch.Tensor], fragment: torch.Tensor) -> None:
        """Make the parameter as the model computes with it follow new fp32 values (see [Note: what a
        fragment write reaches]): ``whole`` (1D, every rank the same) when known, else every rank's
        ``fragment`` (a collective at stages 1-3)."""
        strategy, storage = self.engine.strategy, self.engine.storage
        index, slot = self.bucket.index, self.slot
        with torch.no_grad():
            strategy.publish_piece(self.bucket, self.in_owned[0], fragment)
            sharded = storage if isinstance(storage, ShardedParameters) else None
            gathered = sharded is not None and sharded.state[index] is not GatherState.SHARDED
            if sharded is not None and gathered:
                sharded.wait(index)
            if whole is not None and (gathered or sharded is None):
                storage.bucket_view(self.bucket)[slot.offset: slot.offset + slot.numel].copy_(whole)
            elif whole is None:
                if gathered:  # this rank's part of the bucket's full buffer, which the forward reads
                    start, end = self.in_param
                    storage.full[index][slot.offset + start: slot.offset + end].copy_(fragment)
                strategy.refresh_bucket(self.bucket)  # the buckets kept whole: gathered from the owned chunks
        strategy.finish_refresh()

    # ------------------------------------------------------------------ gradients
    def grads(self) -> Optional[list[torch.Tensor]]:
        """The owned gradient of the bucket that the next step reads, and its copy there (host offload
        copies it to host memory as it is reduced), times the fp16 loss scale; None outside the window
        from the backward at an accumulation boundary to ``step()``, where no averaged gradient exists."""
        engine = self.engine
        if not engine._boundary_backward_done:  # set by a boundary's backward, cleared by step()
            return None
        held = [engine.strategy.owned_grad(self.bucket)]
        if isinstance(engine.updater, HostUpdater):
            held.append(engine.updater.step_grads([])[self.bucket.index])
        return held

    def read_grad(self) -> Optional[torch.Tensor]:
        """The fragment's averaged gradient (fp32, 1D on the device, unscaled), or None (see :meth:`grads`)."""
        held = self.grads()
        if held is None:
            return None
        start, end = self.in_owned
        scale = self.engine.loss_scaler.scale
        out = held[-1][start:end].to(device=self.device, dtype=torch.float32)
        return out / scale if scale != 1.0 else out.clone()

    def write_grad(self, values: torch.Tensor) -> None:
        """Set the fragment's averaged gradient (fp32, 1D, unscaled) for the next step."""
        held = self.grads()
        if held is None:
            raise GradientsUnavailableError(
                f"{self.slot.name}: gradients exist from the backward at a gradient accumulation boundary "
                f"until step(); set them in that window")
        start, end = self.in_owned
        scaled = values * self.engine.loss_scaler.scale
        with torch.no_grad():
            for grad in held:
                grad[start:end].copy_(scaled)
