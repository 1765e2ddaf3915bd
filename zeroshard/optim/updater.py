"""What the optimizer updates for each bucket, where those values live, and one bucket's update.

[Note: pieces]
The torch optimizer steps *pieces*: 1D tensors wrapped as Parameters, stepped bucket by bucket (see
[Note: stepping bucket by bucket] in engine.py).  Where a piece's values live depends on the run:

- fp32 without offload: one piece per bucket, a view of the owned parameters themselves;
- mixed precision, or ``offload_optimizer.device: cpu``: pieces view the fp32 master weights (on the
  training device, or in host memory under offload); after its update a piece is *published*:
  written, rounded to the parameters' dtype, into the owned parameters;
- ``offload_optimizer.device: nvme``: a piece's master values and optimizer state live in swap files
  and are in host memory only while it is updated (see [Note: NVMe sub-groups]).

Under offload a bucket's owned chunk is cut into pieces of at most ``sub_group_size`` elements
(rounded down to a multiple of 64, see [Note: cutting pieces]): the unit of swapping, and what
bounds the fp32 gradient copied to the host at once.

[Note: NVMe sub-groups]
At the start of a step, the first ``buffer_count - 1`` pieces are queued for reading (values and
state) on the swap thread; each piece is then updated as soon as its read is done, queued for writing,
and the next piece's read is queued behind that write.  The update of one piece thus overlaps the
reads of the next ones, and host memory holds at most ``buffer_count`` pieces.  Between steps a
piece's tensors are released: its Parameter holds zero elements and its state holds only ``step``.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import nn

from ..config.schema import OffloadOptimizerConfig
from ..offload import SwapDirectory, SwapFile, SwapIO, preflight_nvme
from ..sharding.layout import BucketLayout

if TYPE_CHECKING:
    from ..distributed.collectives import Collectives
    from ..sharding.strategy import ShardingStrategy

_EMPTY = torch.empty(0)


@dataclass
class Piece:
    """One tensor the optimizer updates: ``numel`` elements from ``start`` in its bucket's owned chunk."""

    bucket: int
    start: int
    numel: int
    param: nn.Parameter
    files: dict[str, SwapFile] = field(default_factory=dict)  # nvme: "param" and each state key


#: pieces start at multiples of this many elements (see [Note: cutting pieces])
PIECE_ALIGNMENT = 64


def _split(numel: int, size: int) -> list[tuple[int, int]]:
    """[Note: cutting pieces]
    torch's fused AdamW on CPU processes a tensor in SIMD vectors from its first element, with a
    scalar loop for the last few, and the two paths may round differently.  Cutting a chunk into
    pieces at multiples of 64 elements (a multiple of every vector width) keeps each element on the
    path it takes when the whole chunk is stepped at once: offloaded updates stay bitwise equal.
    """
    size = max(PIECE_ALIGNMENT, size // PIECE_ALIGNMENT * PIECE_ALIGNMENT)
    return [(s, min(size, numel - s)) for s in range(0, numel, size)] or [(0, 0)]


class ShardUpdater:
    """The pieces of every bucket, the optimizer's step over them, and their state for checkpoints."""

    def __init__(self, strategy: "ShardingStrategy", offload: OffloadOptimizerConfig, sub_group_size: int,
                 comm: "Collectives") -> None:
        self.strategy = strategy
        self.layout = strategy.layout
        self.offload = offload.device
        self.masters = strategy.masters
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.pieces: list[list[Piece]] = []
        self.state_keys: list[str] = []
        self._swap: Optional[SwapDirectory] = None
        self._io: Optional[SwapIO] = None
        self.host_grads: Optional[torch.Tensor] = None
        self._pending_reads: dict[int, Future[None]] = {}
        self._pending_writes: list[Future[None]] = []
        size = sub_group_size if self.offload != "none" else None
        for bucket in self.layout.buckets:
            if self.masters is None:
                view = strategy.owned_param(bucket)
                self.pieces.append([Piece(bucket.index, 0, view.numel(), nn.Parameter(view, requires_grad=False))])
                continue
            chunk = self.masters.chunk(bucket)
            spans = _split(chunk.numel(), size) if size else [(0, chunk.numel())]
            self.pieces.append([Piece(bucket.index, s, n, nn.Parameter(chunk[s: s + n], requires_grad=False))
                                for s, n in spans])
        if self.offload == "cpu":
            assert self.masters is not None
            self.host_grads = torch.zeros_like(self.masters.data)  # filled as buckets are reduced
            if self.masters.data.is_pinned():  # pin_memory: asynchronous device-to-host copies
                self.host_grads = self.host_grads.pin_memory()
            strategy.on_reduced = self.grad_reduced
        elif self.offload == "nvme":
            self._to_nvme(offload, comm, sub_group_size)

    # ------------------------------------------------------------------ set-up
    def _to_nvme(self, offload: OffloadOptimizerConfig, comm: "Collectives", sub_group_size: int) -> None:
        """Move every piece's master values to swap files; state files follow at the first step."""
        assert self.masters is not None
        largest = max(p.numel for pieces in self.pieces for p in pieces)
        # values + two Adam moments per piece, buffer_count pieces in memory at once
        disk = 3 * self.masters.data.numel() * 4
        preflight_nvme(comm, offload.nvme_path, "zero_optimization.offload_optimizer.nvme_path", disk,
                       offload.buffer_count * 3 * largest * 4)
        self._swap = SwapDirectory(offload.nvme_path, comm.world.rank, "optimizer")
        self._io = SwapIO()
        # the swap files are this run's scratch space: removed when the engine goes or the process exits
        self._finalizer = weakref.finalize(self, _close_swap, self._io, self._swap)
        self.buffer_count = offload.buffer_count
        for pieces in self.pieces:
            for piece in pieces:
                piece.files["param"] = self._swap.file(f"b{piece.bucket}_{piece.start}.param", piece.numel * 4)
                piece.files["param"].write(piece.param.data.contiguous())
                piece.param.data = _EMPTY
        self.masters.release()

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def params_of(self, bucket: BucketLayout) -> list[nn.Parameter]:
        return [p.param for p in self.pieces[bucket.index]]

    def owned_numel(self, bucket: BucketLayout) -> int:
        return sum(p.numel for p in self.pieces[bucket.index])

    # ------------------------------------------------------------------ gradients
    def grad_reduced(self, bucket: BucketLayout) -> None:
        """cpu offload: copy the bucket's averaged owned gradient to host memory as soon as it is reduced."""
        assert self.host_grads is not None and self.masters is not None
        target = self.masters.view_of(self.host_grads, bucket)
        target.copy_(self.strategy.owned_grad(bucket), non_blocking=target.is_pinned())

    def step_grads(self) -> list[torch.Tensor]:
        """Per bucket, the owned gradient the update reads (host copies under cpu offload)."""
        if self.host_grads is None:
            return [self.strategy.owned_grad(b) for b in self.layout.buckets]
        if torch.cuda.is_available() and self.strategy.flat.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the non-blocking device-to-host copies
        assert self.masters is not None
        return [self.masters.view_of(self.host_grads, b) for b in self.layout.buckets]

    # ------------------------------------------------------------------ the step
    def begin_step(self, order: Sequence[BucketLayout]) -> None:
        self._order = [p for b in order for p in self.pieces[b.index]]
        self._position = 0
        if self._io is not None:
            for piece in self._order[: self.buffer_count - 1]:
                self._queue_read(piece)

    def step_bucket(self, bucket: BucketLayout, grad: torch.Tensor, factor: float) -> None:
        """Update every piece of ``bucket`` from ``grad`` (its owned gradient) times ``factor``, and publish."""
        assert self.optimizer is not None
        for piece in self.pieces[bucket.index]:
            if self._io is not None:
                self._pending_reads.pop(id(piece)).result()  # raises OffloadIOError on a failed read
            g = grad[piece.start: piece.start + piece.numel]
            if self.masters is not None:
                g = g.to(dtype=torch.float32, device=piece.param.device)  # a view when already fp32 there
                if factor != 1.0:
                    g.mul_(factor)
            piece.param.grad = g
            self.optimizer.step()
            piece.param.grad = None
            if self.masters is not None:
                self.strategy.publish_piece(bucket, piece.start, piece.param.data)
            if self._io is not None:
                self._swap_out(piece)
                ahead = self._position + self.buffer_count - 1
                if ahead < len(self._order):
                    self._queue_read(self._order[ahead])
            self._position += 1

    def end_step(self) -> None:
        """nvme: wait until every updated piece is on disk (errors surface here)."""
        for pending in self._pending_writes:
            pending.result()
        self._pending_writes = []

    # ------------------------------------------------------------------ nvme swapping
    def _queue_read(self, piece: Piece) -> None:
        assert self._io is not None and self.optimizer is not None
        values = torch.empty(piece.numel, dtype=torch.float32)
        state = self.optimizer.state[piece.param]
        # a piece not yet stepped has no state files: the optimizer initialises its state
        loaded = {k: torch.empty(piece.numel, dtype=torch.float32) for k in self.state_keys if k in piece.files}
        piece.param.data = values
        state.update(loaded)
        futures = [self._io.read(piece.files["param"], values)] + \
                  [self._io.read(piece.files[k], t) for k, t in loaded.items()]
        def wait_all() -> None:
            for future in futures:
                future.result()

        # queued behind the reads on the one I/O thread: done once they are, with their errors
        self._pending_reads[id(piece)] = self._io.submit(wait_all)

    def _swap_out(self, piece: Piece) -> None:
        assert self._io is not None and self._swap is not None and self.optimizer is not None
        state = self.optimizer.state[piece.param]
        if not self.state_keys:  # the first step created the state: learn its full-size tensors
            self.state_keys = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        for key in self.state_keys:
            if key not in piece.files:
                piece.files[key] = self._swap.file(f"b{piece.bucket}_{piece.start}.{key}", piece.numel * 4)
            self._pending_writes.append(self._io.write(piece.files[key], state.pop(key)))
        self._pending_writes.append(self._io.write(piece.files["param"], piece.param.data))
        piece.param.data = _EMPTY

    # ------------------------------------------------------------------ state for checkpoints
    def read_bucket(self, bucket: BucketLayout) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Copies of ``bucket``'s owned values (fp32 masters or the parameters), full-size state tensors
        and scalar state (Adam's ``step``), wherever they live."""
        assert self.optimizer is not None
        pieces = self.pieces[bucket.index]
        values: list[torch.Tensor] = []
        state_parts: dict[str, list[torch.Tensor]] = {}
        scalars: dict[str, torch.Tensor] = {}
        for piece in pieces:
            state = self.optimizer.state.get(piece.param, {})
            if self._io is not None:
                v = torch.empty(piece.numel, dtype=torch.float32)
                piece.files["param"].read_into(v)
                full = {}
                for key in (k for k in self.state_keys if k in piece.files):  # none before its first step
                    full[key] = torch.empty(piece.numel, dtype=torch.float32)
                    piece.files[key].read_into(full[key])
            else:
                v = piece.param.data.detach().clone()
                full = {k: t.detach().clone() for k, t in state.items()
                        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.numel() == piece.numel}
            values.append(v.reshape(-1))
            for key, t in full.items():
                state_parts.setdefault(key, []).append(t.reshape(-1))
            scalars.update({k: t.detach().clone() for k, t in state.items()
                            if isinstance(t, torch.Tensor) and t.dim() == 0})
        return (torch.cat(values) if len(values) > 1 else values[0],
                {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in state_parts.items()}, scalars)

    def write_bucket(self, bucket: BucketLayout, values: torch.Tensor, state: Optional[dict[str, torch.Tensor]],
                     scalars: dict[str, torch.Tensor]) -> None:
        """Set ``bucket``'s owned values (and, unless ``state`` is None, its optimizer state), then publish."""
        assert self.optimizer is not None
        for piece in self.pieces[bucket.index]:
            part = values[piece.start: piece.start + piece.numel]
            opt_state = self.optimizer.state[piece.param]
            if self._io is not None:
                assert self._swap is not None
                part = part.to(torch.float32).contiguous()
                piece.files["param"].write(part)
                if state is not None:
                    self.state_keys = list(state)
                    for key, t in state.items():
                        if key not in piece.files:
                            piece.files[key] = self._swap.file(f"b{piece.bucket}_{piece.start}.{key}", piece.numel * 4)
                        piece.files[key].write(t[piece.start: piece.start + piece.numel].to(torch.float32).contiguous())
                    opt_state.clear()
                    opt_state.update({k: v.clone() for k, v in scalars.items()})
            else:
                piece.param.data.copy_(part)
                if state is not None:
                    opt_state.clear()
                    opt_state.update({k: t[piece.start: piece.start + piece.numel].to(piece.param.dtype).clone()
                                      for k, t in state.items()})
                    opt_state.update({k: v.clone() for k, v in scalars.items()})
            if self.masters is not None:
                self.strategy.publish_piece(bucket, piece.start, part)

    # ------------------------------------------------------------------ accounting
    def memory(self) -> dict[str, int]:
        """Bytes of the optimizer's values and state by place: real elements, padding, scalars."""
        assert self.optimizer is not None
        out = {"real": 0, "padding": 0, "other": 0, "host": 0, "nvme": 0, "host_buffers": 0}
        size = 4
        for bucket in self.layout.buckets:
            owned_real = self.strategy.owned_real(bucket)
            owned = self.owned_numel(bucket)
            tensors = 0
            for piece in self.pieces[bucket.index]:
                for value in self.optimizer.state.get(piece.param, {}).values():
                    if isinstance(value, torch.Tensor) and value.dim() == 0:
                        out["other"] += value.numel() * value.element_size()
            if self.masters is None:  # in place: the state tensors only
                first = self.optimizer.state.get(self.pieces[bucket.index][0].param, {})
                tensors = sum(1 for v in first.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
                size = self.pieces[bucket.index][0].param.element_size()
            else:
                tensors = 1 + len(self.state_keys or self._resident_keys(bucket))
            out["real"] += tensors * owned_real * size
            out["padding"] += tensors * (owned - owned_real) * size
        if self.offload == "cpu":
            out["host"] = out["real"]
            assert self.host_grads is not None
            out["host_buffers"] = self.host_grads.numel() * 4
        elif self.offload == "nvme":
            out["nvme"] = out["real"]
        return out

    def _resident_keys(self, bucket: BucketLayout) -> list[str]:
        assert self.optimizer is not None
        first = self.optimizer.state.get(self.pieces[bucket.index][0].param, {})
        return [k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() > 0]

    def close(self) -> None:
        """Remove the swap files (also done when the updater goes or the process exits)."""
        if self._io is not None:
            self._finalizer()


def _close_swap(io: Optional[SwapIO], swap: Optional[SwapDirectory]) -> None:
    if io is not None:
        io.shutdown()
    if swap is not None:
        swap.remove()
