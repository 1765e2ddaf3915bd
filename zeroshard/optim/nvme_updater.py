"""NVMe offload (ZeRO-Infinity): masters and optimizer state in swap files, a few pieces in memory at once.

[Note: NVMe sub-groups]
At the start of a step, the first ``buffer_count - 1`` pieces are queued for reading (values and
state) on the swap thread; each piece is then updated as soon as its read is done and queued for
writing, and the next piece's read is queued behind it.  The update of one piece thus overlaps the
I/O of the others.  Pieces being read, updated or written are at most ``buffer_count`` (a read
waits for the oldest write to finish first), which is what the pre-flight check budgets.  Between
steps a piece's tensors are released: its Parameter holds zero elements and its state holds only
scalars (``step``).  A failed read or write does not stop this rank on the spot, which would leave
the others waiting in the next collective: the rank skips the rest of the update, and the engine
raises on every rank together (:meth:`NVMeUpdater.take_failure`).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import nn

from ..offload.master_swap import MasterSwap
from ..offload.policy import Place, SwapFailure
from ..sharding.layout import BucketLayout
from .updater import Piece, ShardUpdater, full_size_state

if TYPE_CHECKING:
    from ..sharding.strategy import ShardingStrategy

_EMPTY = torch.empty(0)


class NVMeUpdater(ShardUpdater):
    """Each piece's values and state live in swap files between steps; read ahead, stepped, written back."""

    place = Place.NVME

    def __init__(self, strategy: "ShardingStrategy") -> None:
        masters = strategy.masters
        if masters is None or masters.spill is None:
            raise ValueError("NVMe optimizer offload needs masters that spill to swap files")
        self.swap: MasterSwap = masters.spill
        self._pending_reads: dict[int, Future[None]] = {}
        self._pending_writes: deque[list[Future[None]]] = deque()
        self._order: list[Piece] = []
        self._position = 0
        super().__init__(strategy)

    def make_pieces(self, bucket: BucketLayout) -> list[Piece]:
        return [Piece(bucket.index, s, n, nn.Parameter(_EMPTY, requires_grad=False),
                      {"param": self.swap.files[(bucket.index, s)]})
                for s, n in self.swap.pieces[bucket.index]]

    def prepare_step(self, grads: list[torch.Tensor], clip: float, scale: float) -> tuple[list[torch.Tensor], float]:
        return grads, clip / scale

    # ------------------------------------------------------------------ the step
    def begin_step(self, order: Sequence[BucketLayout]) -> None:
        self._order = [p for b in order for p in self.pieces[b.index]]
        self._position = 0
        for piece in self._order[: self.swap.buffer_count - 1]:
            self._queue_read(piece)

    def step_bucket(self, bucket: BucketLayout, grad: torch.Tensor, factor: float) -> None:
        assert self.optimizer is not None
        for piece in self.pieces[bucket.index]:
            self._position += 1
            self.swap.wait(self._pending_reads.pop(id(piece), None))
            if self.swap.failure is not None:
                continue  # the rank is failing: collectives go on, updates stop (see the Note)
            g = grad[piece.start: piece.start + piece.numel].to(dtype=torch.float32, device=piece.param.device)
            if factor != 1.0:
                g.mul_(factor)
            piece.param.grad = g
            self.optimizer.step()
            piece.param.grad = None
            self.strategy.publish_piece(bucket, piece.start, piece.param.data)
            self._swap_out(piece)
            ahead = self._position + self.swap.buffer_count - 2
            if ahead < len(self._order):
                self._queue_read(self._order[ahead])

    def end_step(self) -> None:
        """Wait until every updated piece is on disk."""
        while self._pending_writes:
            for future in self._pending_writes.popleft():
                self.swap.wait(future)

    def take_failure(self) -> SwapFailure:
        return self.swap.take_failure()

    def close(self) -> None:
        self.swap.close()

    def _queue_read(self, piece: Piece) -> None:
        assert self.optimizer is not None
        if self.swap.failure is not None:
            return
        while len(self._pending_reads) + len(self._pending_writes) >= self.swap.buffer_count:
            for future in self._pending_writes.popleft():  # bounded host memory: the oldest write first
                self.swap.wait(future)
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
        assert self.optimizer is not None
        state = self.optimizer.state[piece.param]
        writes = []
        for key, tensor in full_size_state(state, piece.numel).items():
            if key not in piece.files:  # created by this piece's first step
                piece.files[key] = self.swap.state_file(piece.bucket, piece.start, piece.numel, key)
            writes.append(self.swap.io.write(piece.files[key], tensor))
            del state[key]
        writes.append(self.swap.io.write(piece.files["param"], piece.param.data))
        self._pending_writes.append(writes)
        piece.param.data = _EMPTY

    # ------------------------------------------------------------------ state for checkpoints
    def read_piece(self, piece: Piece, state: dict[str, Any], copy: bool = True
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Read back from the swap files: always fresh tensors."""
        v = torch.empty(piece.numel, dtype=torch.float32)
        piece.files["param"].read_into(v)
        full = {}
        for key in piece.state_keys():
            full[key] = torch.empty(piece.numel, dtype=torch.float32)
            piece.files[key].read_into(full[key])
        return v, full

    def write_piece(self, piece: Piece, values: torch.Tensor, state: Optional[dict[str, torch.Tensor]]) -> None:
        piece.files["param"].write(values.to(torch.float32).contiguous())
        for key, t in (state or {}).items():
            if key not in piece.files:
                piece.files[key] = self.swap.state_file(piece.bucket, piece.start, piece.numel, key)
            piece.files[key].write(t.to(torch.float32).contiguous())

    def state_tensor_count(self, first: Piece) -> int:
        return 1 + len(first.state_keys())
