"""What the optimizer updates for each bucket, where those values live, and one bucket's update.

[Note: pieces]
The torch optimizer steps *pieces*: 1D tensors wrapped as Parameters, stepped bucket by bucket (see
[Note: stepping bucket by bucket] in engine/optimizer_step.py).  Where a piece's values live depends on the run:

- fp32 without offload (:class:`ParamUpdater`): one piece per bucket, a view of the owned parameters;
- mixed precision (:class:`MasterUpdater`), or ``offload_optimizer.device: cpu``
  (:class:`~.host_updater.HostUpdater`): pieces view the fp32 master weights (on the training device,
  or in host memory); after its update a piece is *published*: written, rounded to the parameters'
  dtype, into the owned parameters;
- ``offload_optimizer.device: nvme`` (:class:`~.nvme_updater.NVMeUpdater`): a piece's master values
  and optimizer state live in swap files and are in host memory only while it is read, updated and
  written (see [Note: NVMe sub-groups] in optim/nvme_updater.py).

Which one a run gets is decided once, from the :class:`~zeroshard.offload.policy.OffloadPolicy`
(:func:`~.updaters.build_updater`).

Under offload a bucket's owned chunk is cut into pieces of at most ``sub_group_size`` elements
(rounded down to a multiple of 64, see [Note: cutting pieces] in offload/master_swap.py): the unit of
swapping, and what bounds the fp32 gradient copied to the host at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Sequence

import torch
from torch import nn

from ..offload.policy import Place, SwapFailure
from ..offload.swap_files import SwapFile
from ..sharding.layout import BucketLayout
from .clipping import clip_
from .muon import whole_matrix_groups
from .whole_matrices import WholeMatrixError, WholeMatrixSteps

if TYPE_CHECKING:
    from ..sharding.strategy import ShardingStrategy


@dataclass
class Piece:
    """One tensor the optimizer updates: ``numel`` elements from ``start`` in its bucket's owned chunk."""

    bucket: int
    start: int
    numel: int
    param: nn.Parameter
    files: dict[str, SwapFile] = field(default_factory=dict)  # nvme: "param" and each of its state tensors

    def state_keys(self) -> list[str]:
        return [k for k in self.files if k != "param"]


def full_size_state(state: dict, numel: int) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == numel}


def scalar_state(state: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 0}


#: what a bucket's optimizer-side state is, for checkpoints: owned values, full-size state, scalar state
BucketState = tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]


class ShardUpdater(ABC):
    """The pieces of every bucket, the optimizer's step over them, and their state for checkpoints."""

    #: where the optimizer's values and state live (for the memory breakdown)
    place: ClassVar[Place] = Place.DEVICE

    def __init__(self, strategy: "ShardingStrategy") -> None:
        self.strategy = strategy
        self.layout = strategy.layout
        self.masters = strategy.masters
        self.optimizer: Optional[torch.optim.Optimizer] = None
        #: the groups whose matrices are stepped whole (Muon, Adafactor), else None
        self.matrices: Optional[WholeMatrixSteps] = None
        self.pieces: list[list[Piece]] = [self.make_pieces(b) for b in self.layout.buckets]

    @abstractmethod
    def make_pieces(self, bucket: BucketLayout) -> list[Piece]:
        """The tensors the optimizer steps for ``bucket``'s owned chunk."""

    def attach(self, optimizer: torch.optim.Optimizer, sliced: bool = False) -> None:
        """``sliced``: tensor parallelism holds slices of the matrices (refused to an optimizer that needs
        them whole)."""
        self.optimizer = optimizer
        groups = whole_matrix_groups(optimizer)
        if groups and sliced:
            raise WholeMatrixError(f"{type(optimizer).__name__} steps whole matrices, and tensor parallelism gives "
                                   f"each rank a slice of them; train without tensor parallelism, or use AdamW")
        if groups:
            if self.place is Place.NVME:
                raise WholeMatrixError(f"{type(optimizer).__name__} steps whole matrices, which NVMe offload does "
                                       f"not hold in memory; offload the optimizer to the cpu, or use AdamW")
            owned = {b.index: (self.owned_numel(b), self.pieces[b.index][0].param.data) for b in self.layout.buckets}
            self.matrices = WholeMatrixSteps(self.strategy, optimizer, owned, groups)

    def params_of(self, bucket: BucketLayout) -> list[nn.Parameter]:
        return [p.param for p in self.pieces[bucket.index]]

    def owned_numel(self, bucket: BucketLayout) -> int:
        return sum(p.numel for p in self.pieces[bucket.index])

    # ------------------------------------------------------------------ gradients
    def grad_reduced(self, bucket: BucketLayout) -> None:
        """Called as each bucket's gradients are averaged at a boundary (see ``add_reduced_listener``)."""

    @abstractmethod
    def prepare_step(self, grads: list[torch.Tensor], clip: float, scale: float) -> tuple[list[torch.Tensor], float]:
        """Per bucket, the gradient the update reads, and the factor it is multiplied by (1 / loss
        scale times the clipping coefficient ``clip``), given the owned gradients ``grads``."""

    # ------------------------------------------------------------------ the step
    def begin_step(self, order: Sequence[BucketLayout]) -> None:
        """A step over ``order`` (the buckets, in the order they will be stepped) starts."""

    def step_bucket(self, bucket: BucketLayout, grad: torch.Tensor, factor: float) -> None:
        """Update every piece of ``bucket`` from ``grad`` (its owned gradient) times ``factor``, and publish."""
        assert self.optimizer is not None
        if self.matrices is not None and self.matrices.covers(bucket):
            self._step_whole_matrices(bucket, grad, factor)
            return
        for piece in self.pieces[bucket.index]:
            piece.param.grad = self.piece_grad(piece, grad[piece.start: piece.start + piece.numel], factor)
            self.optimizer.step()
            piece.param.grad = None
            self.after_piece_step(bucket, piece)

    def spread_state(self) -> None:
        """Before a save, on every rank: the whole-matrix state into chunks (see [Note: whole-matrix
        state in a checkpoint] in optim/whole_matrices.py)."""
        if self.matrices is not None:
            self.matrices.spread_state({b.index: self._owned_values(b) for b in self.layout.buckets
                                        if self.matrices.covers(b)})

    def _owned_values(self, bucket: BucketLayout) -> torch.Tensor:
        """The bucket's owned values, its pieces joined (a copy where there are several)."""
        pieces = self.pieces[bucket.index]
        return pieces[0].param.data if len(pieces) == 1 else torch.cat([p.param.data for p in pieces])

    def _step_whole_matrices(self, bucket: BucketLayout, grad: torch.Tensor, factor: float) -> None:
        """The bucket's matrices stepped whole (see [Note: whole matrices, each on one rank] in
        optim/whole_matrices.py): its pieces are the owned chunk, cut or not."""
        assert self.matrices is not None
        pieces = self.pieces[bucket.index]
        grads = [self.piece_grad(p, grad[p.start: p.start + p.numel], factor) for p in pieces]
        values = self._owned_values(bucket)
        self.matrices.step_bucket(bucket, values, grads[0] if len(grads) == 1 else torch.cat(grads))
        for piece in pieces:
            if len(pieces) > 1:
                piece.param.data.copy_(values[piece.start: piece.start + piece.numel])
            self.after_piece_step(bucket, piece)

    def piece_grad(self, piece: Piece, grad: torch.Tensor, factor: float) -> torch.Tensor:
        return grad

    def after_piece_step(self, bucket: BucketLayout, piece: Piece) -> None:
        """The piece was just updated."""

    def end_step(self) -> None:
        """The step is over (NVMe: every updated piece is on disk)."""

    def take_failure(self) -> SwapFailure:
        """A swap failure to raise on every rank (NVMe), once."""
        return None

    def close(self) -> None:
        """Release files and threads (NVMe); idempotent."""

    # ------------------------------------------------------------------ state for checkpoints
    def read_bucket(self, bucket: BucketLayout, copy: bool = True) -> BucketState:
        """``bucket``'s owned values (fp32 masters or the parameters), full-size state tensors and scalar
        state (Adam's ``step``), wherever they live: copies, or with ``copy=False`` the tensors
        themselves where they are resident and whole (a synchronous save, which writes them before
        training resumes, need not copy a model-size state first)."""
        assert self.optimizer is not None
        values: list[torch.Tensor] = []
        state_parts: dict[str, list[torch.Tensor]] = {}
        scalars: dict[str, torch.Tensor] = {}
        for piece in self.pieces[bucket.index]:
            state = self.optimizer.state.get(piece.param, {})
            v, full = self.read_piece(piece, state, copy)
            values.append(v.reshape(-1))
            for key, t in full.items():
                state_parts.setdefault(key, []).append(t.reshape(-1))
            scalars.update({k: t.detach().clone() for k, t in scalar_state(state).items()})
        if self.matrices is not None and self.matrices.covers(bucket):
            # see [Note: whole-matrix state in a checkpoint] in optim/whole_matrices.py
            state_parts.update({k: [t] for k, t in self.matrices.spread.get(bucket.index, {}).items()})
            scalars.update(self.matrices.scalars(bucket))
        return (torch.cat(values) if len(values) > 1 else values[0],
                {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in state_parts.items()}, scalars)

    def read_piece(self, piece: Piece, state: dict[str, Any], copy: bool = True
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The piece's values and full-size state (copies with ``copy``)."""
        def taken(t: torch.Tensor) -> torch.Tensor:
            return t.detach().clone() if copy else t.detach()
        return taken(piece.param.data), {k: taken(t) for k, t in full_size_state(state, piece.numel).items()}

    def write_bucket(self, bucket: BucketLayout, values: torch.Tensor, state: Optional[dict[str, torch.Tensor]],
                     scalars: dict[str, torch.Tensor]) -> None:
        """Set ``bucket``'s owned values (and, unless ``state`` is None, its optimizer state), then publish."""
        assert self.optimizer is not None
        if self.matrices is not None and self.matrices.covers(bucket):
            # the state goes to the owners, the chunks keep none (see [Note: whole-matrix state in a
            # checkpoint] in optim/whole_matrices.py)
            if state is not None:
                self.matrices.load_state(bucket, state, scalars, values)
            state, scalars = (None, {}) if state is None else ({}, {})
        for piece in self.pieces[bucket.index]:
            part = values[piece.start: piece.start + piece.numel]
            opt_state = self.optimizer.state[piece.param]
            if state is not None:
                opt_state.clear()
                opt_state.update({k: self._place_scalar(piece, v) for k, v in scalars.items()})
            self.write_piece(piece, part, None if state is None else
                             {k: t[piece.start: piece.start + piece.numel] for k, t in state.items()})
            if self.masters is not None:
                self.strategy.publish_piece(bucket, piece.start, part)

    def write_piece(self, piece: Piece, values: torch.Tensor, state: Optional[dict[str, torch.Tensor]]) -> None:
        """Store the piece's values and (unless None) its full-size state."""
        piece.param.data.copy_(values)
        if state is not None and self.optimizer is not None:
            self.optimizer.state[piece.param].update({k: t.to(piece.param.dtype).clone() for k, t in state.items()})

    def _place_scalar(self, piece: Piece, value: torch.Tensor) -> torch.Tensor:
        """Where torch's own ``load_state_dict`` would put it: the fused and capturable kernels read
        ``step`` on the parameter's device, the others on the CPU."""
        assert self.optimizer is not None
        group = next(g for g in self.optimizer.param_groups if any(p is piece.param for p in g["params"]))
        on_device = group.get("fused") or group.get("capturable")
        device = piece.param.device if on_device and self.place is not Place.NVME else torch.device("cpu")
        return value.to(device=device, dtype=torch.float32).clone()

    # ------------------------------------------------------------------ accounting
    def state_tensor_count(self, first: Piece) -> int:
        """Full-size tensors per owned element: the optimizer's state, plus the masters if any."""
        assert self.optimizer is not None
        resident = full_size_state(self.optimizer.state.get(first.param, {}), first.numel)
        return len(resident) + (0 if self.masters is None else 1)

    def host_buffer_bytes(self) -> int:
        """Host buffers beyond the state (host offload: the fp32 gradient copies)."""
        return 0

    def memory(self) -> dict[str, int]:
        """Bytes of the optimizer's values and state by place: real elements, padding, scalars."""
        assert self.optimizer is not None
        out = {"real": 0, "padding": 0, "other": 0, "host": 0, "nvme": 0, "host_buffers": self.host_buffer_bytes()}
        for bucket in self.layout.buckets:
            owned_real = self.strategy.owned_real(bucket)
            owned = self.owned_numel(bucket)
            first = self.pieces[bucket.index][0]
            size = first.param.element_size() if self.masters is None else 4
            tensors = self.state_tensor_count(first)
            for piece in self.pieces[bucket.index]:
                out["other"] += sum(v.numel() * v.element_size()
                                    for v in scalar_state(self.optimizer.state.get(piece.param, {})).values())
            out["real"] += tensors * owned_real * size
            out["padding"] += tensors * (owned - owned_real) * size
        if self.matrices is not None:  # the matrices' state: only on the ranks that own them
            out["real"] += self.matrices.state_bytes()
            out["other"] += self.matrices.scalar_bytes()
        if self.place is Place.HOST:
            out["host"] = out["real"]
        elif self.place is Place.NVME:
            out["nvme"] = out["real"]
        return out


class ParamUpdater(ShardUpdater):
    """fp32 without offload: the optimizer steps the owned parameters themselves (one piece per bucket)."""

    def make_pieces(self, bucket: BucketLayout) -> list[Piece]:
        view = self.strategy.owned_param(bucket)
        return [Piece(bucket.index, 0, view.numel(), nn.Parameter(view, requires_grad=False))]

    def prepare_step(self, grads: list[torch.Tensor], clip: float, scale: float) -> tuple[list[torch.Tensor], float]:
        """The optimizer reads the gradient buffers themselves: clipped in place (no loss scale in fp32)."""
        if clip < 1.0:
            with torch.no_grad():
                clip_(grads, clip)
        return grads, 1.0


class MasterUpdater(ShardUpdater):
    """fp32 masters in memory (mixed precision): the optimizer steps them, then they are published."""

    def __init__(self, strategy: "ShardingStrategy") -> None:
        if strategy.masters is None:
            raise ValueError("MasterUpdater needs fp32 master weights (mixed precision or optimizer offload)")
        self.master_weights = strategy.masters
        super().__init__(strategy)

    def make_pieces(self, bucket: BucketLayout) -> list[Piece]:
        chunk = self.master_weights.chunk(bucket)
        return [Piece(bucket.index, s, n, nn.Parameter(chunk[s: s + n], requires_grad=False))
                for s, n in self.spans(chunk.numel())]

    def spans(self, numel: int) -> list[tuple[int, int]]:
        """(start, numel) of the pieces of a chunk: one piece on the device."""
        return [(0, numel)]

    def prepare_step(self, grads: list[torch.Tensor], clip: float, scale: float) -> tuple[list[torch.Tensor], float]:
        """The update reads fp32 copies, unscaled and clipped by the factor."""
        return self.step_grads(grads), clip / scale

    def step_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return grads

    def piece_grad(self, piece: Piece, grad: torch.Tensor, factor: float) -> torch.Tensor:
        g = grad.to(dtype=torch.float32, device=piece.param.device)  # a view when already fp32 there
        if factor != 1.0:
            g.mul_(factor)
        return g

    def after_piece_step(self, bucket: BucketLayout, piece: Piece) -> None:
        self.strategy.publish_piece(bucket, piece.start, piece.param.data)
