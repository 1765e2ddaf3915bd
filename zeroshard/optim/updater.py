"""What the optimizer updates for each bucket, where those values live, and one bucket's update.

[Note: pieces]
The torch optimizer steps *pieces*: 1D tensors wrapped as Parameters, stepped bucket by bucket (see
[Note: stepping bucket by bucket] in engine.py).  Where a piece's values live depends on the run:

- fp32 without offload: one piece per bucket, a view of the owned parameters themselves;
- mixed precision, or ``offload_optimizer.device: cpu``: pieces view the fp32 master weights (on the
  training device, or in host memory under offload); after its update a piece is *published*:
  written, rounded to the parameters' dtype, into the owned parameters;
- ``offload_optimizer.device: nvme``: a piece's master values and optimizer state live in swap files
  and are in host memory only while it is read, updated and written (see [Note: NVMe sub-groups]).

Under offload a bucket's owned chunk is cut into pieces of at most ``sub_group_size`` elements
(rounded down to a multiple of 64, see [Note: cutting pieces]): the unit of swapping, and what
bounds the fp32 gradient copied to the host at once.

[Note: NVMe sub-groups]
At the start of a step, the first ``buffer_count - 1`` pieces are queued for reading (values and
state) on the swap thread; each piece is then updated as soon as its read is done and queued for
writing, and the next piece's read is queued behind it.  The update of one piece thus overlaps the
I/O of the others.  Pieces being read, updated or written are at most ``buffer_count`` (a read
waits for the oldest write to finish first), which is what the pre-flight check budgets.  Between
steps a piece's tensors are released: its Parameter holds zero elements and its state holds only
scalars (``step``).  A failed read or write does not stop this rank on the spot, which would leave
the others waiting in the next collective: the rank skips the rest of the update, and the engine
raises on every rank together (:meth:`ShardUpdater.take_failure`).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import nn

from ..config.schema import OffloadOptimizerConfig
from ..offload import OffloadIOError, SwapFile
from ..offload.master_swap import MasterSwap, split_pieces
from ..sharding.layout import BucketLayout

if TYPE_CHECKING:
    from ..sharding.strategy import ShardingStrategy

_EMPTY = torch.empty(0)


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


def _full_size_state(state: dict, numel: int) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == numel}


def _scalar_state(state: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 0}


class ShardUpdater:
    """The pieces of every bucket, the optimizer's step over them, and their state for checkpoints."""

    def __init__(self, strategy: "ShardingStrategy", offload: OffloadOptimizerConfig, sub_group_size: int) -> None:
        self.strategy = strategy
        self.layout = strategy.layout
        self.offload = offload.device
        self.masters = strategy.masters
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.pieces: list[list[Piece]] = []
        self.host_grads: Optional[torch.Tensor] = None
        self._copies: list[torch.cuda.Event] = []
        self.swap: Optional[MasterSwap] = self.masters.spill if self.masters is not None else None
        self._pending_reads: dict[int, Future[None]] = {}
        self._pending_writes: deque[list[Future[None]]] = deque()
        self.failure: Optional[OffloadIOError] = None
        for bucket in self.layout.buckets:
            if self.masters is None:
                view = strategy.owned_param(bucket)
                self.pieces.append([Piece(bucket.index, 0, view.numel(), nn.Parameter(view, requires_grad=False))])
            elif self.swap is not None:
                self.pieces.append([Piece(bucket.index, s, n, nn.Parameter(_EMPTY, requires_grad=False),
                                          {"param": self.swap.files[(bucket.index, s)]})
                                    for s, n in self.swap.pieces[bucket.index]])
            else:
                chunk = self.masters.chunk(bucket)
                spans = split_pieces(chunk.numel(), sub_group_size) if self.offload == "cpu" else [(0, chunk.numel())]
                self.pieces.append([Piece(bucket.index, s, n, nn.Parameter(chunk[s: s + n], requires_grad=False))
                                    for s, n in spans])
        if self.offload == "cpu":
            assert self.masters is not None
            self.host_grads = torch.zeros(self.masters.data.numel(), dtype=torch.float32,
                                          pin_memory=self.masters.data.is_pinned())  # filled as buckets are reduced
            strategy.on_reduced = self.grad_reduced

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
        source = self.strategy.owned_grad(bucket)
        target.copy_(source, non_blocking=target.is_pinned())
        if source.is_cuda and target.is_pinned():  # on the stream backward ran on: waited for in step_grads
            event = torch.cuda.Event()
            event.record()
            self._copies.append(event)

    def step_grads(self) -> list[torch.Tensor]:
        """Per bucket, the owned gradient the update reads (host copies under cpu offload)."""
        if self.host_grads is None:
            return [self.strategy.owned_grad(b) for b in self.layout.buckets]
        for event in self._copies:  # the non-blocking device-to-host copies have landed
            event.synchronize()
        self._copies = []
        assert self.masters is not None
        return [self.masters.view_of(self.host_grads, b) for b in self.layout.buckets]

    # ------------------------------------------------------------------ the step
    def begin_step(self, order: Sequence[BucketLayout]) -> None:
        self._order = [p for b in order for p in self.pieces[b.index]]
        self._position = 0
        if self.swap is not None:
            for piece in self._order[: self.swap.buffer_count - 1]:
                self._queue_read(piece)

    def step_bucket(self, bucket: BucketLayout, grad: torch.Tensor, factor: float) -> None:
        """Update every piece of ``bucket`` from ``grad`` (its owned gradient) times ``factor``, and publish."""
        assert self.optimizer is not None
        for piece in self.pieces[bucket.index]:
            self._position += 1
            if self.swap is not None:
                self._wait(self._pending_reads.pop(id(piece), None))
                if self.failure is not None:
                    continue  # the rank is failing: collectives go on, updates stop (see the Note)
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
            if self.swap is not None:
                self._swap_out(piece)
                ahead = self._position + self.swap.buffer_count - 2
                if ahead < len(self._order):
                    self._queue_read(self._order[ahead])

    def end_step(self) -> None:
        """nvme: wait until every updated piece is on disk."""
        while self._pending_writes:
            for future in self._pending_writes.popleft():
                self._wait(future)

    def take_failure(self) -> Optional[OffloadIOError]:
        failure, self.failure = self.failure, None
        return failure

    def _wait(self, future: Optional[Future[None]]) -> None:
        if future is None:
            return
        try:
            future.result()
        except OffloadIOError as err:
            self.failure = self.failure or err

    # ------------------------------------------------------------------ nvme swapping
    def _queue_read(self, piece: Piece) -> None:
        assert self.swap is not None and self.optimizer is not None
        if self.failure is not None:
            return
        while len(self._pending_reads) + len(self._pending_writes) >= self.swap.buffer_count:
            for future in self._pending_writes.popleft():  # bounded host memory: the oldest write first
                self._wait(future)
        values = torch.empty(piece.numel, dtype=torch.float32)
        state = self.optimizer.state[piece.param]
        # a piece not yet stepped has no state files: the optimizer initialises its state
        loaded = {k: torch.empty(piece.numel, dtype=torch.float32) for k in piece.state_keys()}
        piece.param.data = values
        state.update(loaded)
        futures = [self.swap.io.read(piece.files["param"], values)] + \
                  [self.swap.io.read(piece.files[k], t) for k, t in loaded.items()]

        def wait_all() -> None:
            for future in futures:
                future.result()

        # queued behind the reads on the one I/O thread: done once they are, with their errors
        self._pending_reads[id(piece)] = self.swap.io.submit(wait_all)

    def _swap_out(self, piece: Piece) -> None:
        assert self.swap is not None and self.optimizer is not None
        state = self.optimizer.state[piece.param]
        writes = []
        for key, tensor in _full_size_state(state, piece.numel).items():
            if key not in piece.files:  # created by this piece's first step
                piece.files[key] = self.swap.state_file(piece.bucket, piece.start, piece.numel, key)
            writes.append(self.swap.io.write(piece.files[key], tensor))
            del state[key]
        writes.append(self.swap.io.write(piece.files["param"], piece.param.data))
        self._pending_writes.append(writes)
        piece.param.data = _EMPTY

    # ------------------------------------------------------------------ state for checkpoints
    def read_bucket(self, bucket: BucketLayout) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Copies of ``bucket``'s owned values (fp32 masters or the parameters), full-size state tensors
        and scalar state (Adam's ``step``), wherever they live."""
        assert self.optimizer is not None
        values: list[torch.Tensor] = []
        state_parts: dict[str, list[torch.Tensor]] = {}
        scalars: dict[str, torch.Tensor] = {}
        for piece in self.pieces[bucket.index]:
            state = self.optimizer.state.get(piece.param, {})
            if self.swap is not None:
                v = torch.empty(piece.numel, dtype=torch.float32)
                piece.files["param"].read_into(v)
                full = {}
                for key in piece.state_keys():
                    full[key] = torch.empty(piece.numel, dtype=torch.float32)
                    piece.files[key].read_into(full[key])
            else:
                v = piece.param.data.detach().clone()
                full = {k: t.detach().clone() for k, t in _full_size_state(state, piece.numel).items()}
            values.append(v.reshape(-1))
            for key, t in full.items():
                state_parts.setdefault(key, []).append(t.reshape(-1))
            scalars.update({k: t.detach().clone() for k, t in _scalar_state(state).items()})
        return (torch.cat(values) if len(values) > 1 else values[0],
                {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in state_parts.items()}, scalars)

    def write_bucket(self, bucket: BucketLayout, values: torch.Tensor, state: Optional[dict[str, torch.Tensor]],
                     scalars: dict[str, torch.Tensor]) -> None:
        """Set ``bucket``'s owned values (and, unless ``state`` is None, its optimizer state), then publish."""
        assert self.optimizer is not None
        for piece in self.pieces[bucket.index]:
            part = values[piece.start: piece.start + piece.numel]
            opt_state = self.optimizer.state[piece.param]
            if state is not None:
                opt_state.clear()
                opt_state.update({k: self._place_scalar(piece, v) for k, v in scalars.items()})
            if self.swap is not None:
                part = part.to(torch.float32).contiguous()
                piece.files["param"].write(part)
                for key, t in (state or {}).items():
                    if key not in piece.files:
                        piece.files[key] = self.swap.state_file(piece.bucket, piece.start, piece.numel, key)
                    piece.files[key].write(t[piece.start: piece.start + piece.numel].to(torch.float32).contiguous())
            else:
                piece.param.data.copy_(part)
                if state is not None:
                    opt_state.update({k: t[piece.start: piece.start + piece.numel].to(piece.param.dtype).clone()
                                      for k, t in state.items()})
            if self.masters is not None:
                self.strategy.publish_piece(bucket, piece.start, part)

    def _place_scalar(self, piece: Piece, value: torch.Tensor) -> torch.Tensor:
        """Where torch's own ``load_state_dict`` would put it: the fused and capturable kernels read
        ``step`` on the parameter's device, the others on the CPU."""
        assert self.optimizer is not None
        group = next(g for g in self.optimizer.param_groups if any(p is piece.param for p in g["params"]))
        on_device = group.get("fused") or group.get("capturable")
        device = piece.param.device if on_device and self.swap is None else torch.device("cpu")
        return value.to(device=device, dtype=torch.float32).clone()

    # ------------------------------------------------------------------ accounting
    def memory(self) -> dict[str, int]:
        """Bytes of the optimizer's values and state by place: real elements, padding, scalars."""
        assert self.optimizer is not None
        out = {"real": 0, "padding": 0, "other": 0, "host": 0, "nvme": 0, "host_buffers": 0}
        for bucket in self.layout.buckets:
            owned_real = self.strategy.owned_real(bucket)
            owned = self.owned_numel(bucket)
            first = self.pieces[bucket.index][0]
            size = first.param.element_size() if self.masters is None else 4
            resident = _full_size_state(self.optimizer.state.get(first.param, {}), first.numel)
            tensors = len(resident) + (0 if self.masters is None else 1)
            if self.swap is not None:
                tensors = 1 + len(first.state_keys())
            for piece in self.pieces[bucket.index]:
                out["other"] += sum(v.numel() * v.element_size()
                                    for v in _scalar_state(self.optimizer.state.get(piece.param, {})).values())
            out["real"] += tensors * owned_real * size
            out["padding"] += tensors * (owned - owned_real) * size
        if self.offload == "cpu":
            out["host"] = out["real"]
            assert self.host_grads is not None
            out["host_buffers"] = self.host_grads.numel() * 4
        elif self.offload == "nvme":
            out["nvme"] = out["real"]
        return out

    def close(self) -> None:
        """Remove the swap files (also done when the engine goes or the process exits)."""
        if self.swap is not None:
            self.swap.finalizer()
