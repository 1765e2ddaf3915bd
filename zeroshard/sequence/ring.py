"""Ring attention: attention over sequences split across a sequence-parallel group without a head split.

Each rank of a group of P ranks holds the queries, keys and values of its slice of every sequence.  The
key/value blocks travel round the ring of the group (rank r sends to r + 1 and receives from r - 1), so
that after P - 1 steps every rank's queries have met every block; each block's attention is merged into
the running result with its log-sum-exp (an online softmax), which is exact.  Nothing is split by heads,
so any head count runs at any degree.

[Note: the ring's backward runs the ring again]
The forward keeps only its inputs, its output and the log-sum-exp of every query row; the backward
recomputes each block's probabilities from them (``exp(scores - lse)``), as flash attention does.  The
key/value blocks travel round the ring once more, each with the gradients of its keys and values
accumulated so far: every rank adds its queries' share, and after P steps a block's gradients are back
at the rank that owns it.  The queries' gradient stays where the queries are, summed block by block.
Under a causal mask, blocks wholly in the future of a rank's queries (those from higher ranks of the
group, in the consecutive layout) are passed on without being computed; the messages are the same on
every rank, so the ranks agree on every message of the group.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from ..distributed.collectives import Collectives, PendingCollective

__all__ = ["ring_attention"]


def ring_attention(comm: Collectives, query: Tensor, key: Tensor, value: Tensor, causal: bool) -> Tensor:
    """``softmax(query key^T / sqrt(head_dim)) value`` over the whole sequences, each rank of ``comm``
    holding its consecutive slice: ``query`` ``[b, heads, s/P, d]``, ``key`` and ``value`` ``[b, kv_heads,
    s/P, d]`` (``kv_heads`` dividing ``heads``: consecutive query heads share a key/value head); returns
    ``[b, heads, s/P, value's d]``.  ``causal``: a position attends only to itself and the positions before
    it, positions counted over the whole sequence (rank r's slice is the r-th).  Differentiable; the
    bytes are counted in ``comm``'s ledger as ``sequence_ring_kv`` (``sequence_ring_kv_grad`` in the
    backward)."""
    return _RingAttention.apply(comm, causal, query, key, value)


def _grouped(query: Tensor, kv_heads: int) -> Tensor:
    """``[b, heads, s, d]`` as ``[b, kv_heads, heads / kv_heads, s, d]``: each key/value head's queries."""
    return query.unflatten(1, (kv_heads, -1))


def _pack(*tensors: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: Tensor, like: tuple[Tensor, ...]) -> list[Tensor]:
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in like]), like)]


def _scores(q: Tensor, k: Tensor, scale: float, diagonal: bool) -> Tensor:
    """``q`` ``[b, hk, g, sq, d]`` against ``k`` ``[b, hk, sk, d]``: ``[b, hk, g, sq, sk]``, the future
    masked out on the diagonal block (the same positions on both sides)."""
    scores = q @ k.unsqueeze(2).transpose(-1, -2) * scale
    if diagonal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


class _Ring:
    """The blocks' journey round the group: who holds which block at each step, and the messages."""

    def __init__(self, comm: Collectives, causal: bool) -> None:
        self.comm, self.causal = comm, causal
        self.size, self.rank = comm.world.world_size, comm.world.rank

    def owner(self, step: int) -> int:
        """The rank whose block this rank holds at ``step`` (its own at step 0)."""
        return (self.rank - step) % self.size

    def visible(self, step: int) -> Optional[bool]:
        """Whether this rank's queries see the block held at ``step``: None not at all (wholly in the
        future), True on the diagonal (masked), False wholly."""
        owner = self.owner(step)
        if not self.causal:
            return False
        return None if owner > self.rank else owner == self.rank

    def send_on(self, block: Tensor, label: str) -> tuple[Tensor, PendingCollective]:
        incoming = torch.empty_like(block)
        return incoming, self.comm.send_recv(block, incoming, label, async_op=True)


class _RingAttention(torch.autograd.Function):
    """The ring's forward and backward ([Note: the ring's backward runs the ring again])."""

    @staticmethod
    def forward(ctx: Any, comm: Collectives, causal: bool, query: Tensor, key: Tensor,  # type: ignore[override]
                value: Tensor) -> Tensor:
        ring = _Ring(comm, causal)
        q = _grouped(query, key.shape[1])
        scale = 1.0 / math.sqrt(query.shape[-1])
        block = _pack(key, value)
        out: Optional[Tensor] = None
        lse: Optional[Tensor] = None
        for step in range(ring.size):
            # the next block is on its way while this one is computed
            incoming, pending = ring.send_on(block, "sequence_ring_kv") if step < ring.size - 1 else (None, None)
            diagonal = ring.visible(step)
            if diagonal is not None:
                k, v = _unpack(block, (key, value))
                scores = _scores(q, k, scale, diagonal)
                block_lse = scores.logsumexp(-1, keepdim=True)
                block_out = torch.exp(scores - block_lse) @ v.unsqueeze(2)
                if out is None or lse is None:  # step 0: the rank's own block, which every row sees
                    out, lse = block_out, block_lse
                else:
                    merged = torch.logaddexp(lse, block_lse)
                    out = out * torch.exp(lse - merged) + block_out * torch.exp(block_lse - merged)
                    lse = merged
            if pending is not None and incoming is not None:
                pending.wait()
                block = incoming
        assert out is not None and lse is not None
        ctx.comm, ctx.causal, ctx.scale = comm, causal, scale
        ctx.save_for_backward(query, key, value, out, lse)
        return out.flatten(1, 2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.comm, ctx.causal)
        q, grad_out = _grouped(query, key.shape[1]), _grouped(grad, key.shape[1])
        delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O): the softmax's backward
        grad_q = torch.zeros_like(q)
        like = (key, value, key, value)
        block = _pack(key, value, torch.zeros_like(key), torch.zeros_like(value))
        for step in range(ring.size):
            diagonal = ring.visible(step)
            if diagonal is not None:
                k, v, grad_k, grad_v = _unpack(block, like)
                probs = torch.exp(_scores(q, k, ctx.scale, diagonal) - lse)
                grad_v += (probs.transpose(-1, -2) @ grad_out).sum(2)
                grad_scores = probs * (grad_out @ v.unsqueeze(2).transpose(-1, -2) - delta) * ctx.scale
                grad_q += grad_scores @ k.unsqueeze(2)
                grad_k += (grad_scores.transpose(-1, -2) @ q).sum(2)
            if step == ring.size - 1:  # the gradients alone go on once more, to the block's owner
                block = block[key.numel() + value.numel():]
            block, pending = ring.send_on(block, "sequence_ring_kv_grad")
            pending.wait()
        grad_key, grad_value = _unpack(block, (key, value))
        return None, None, grad_q.flatten(1, 2), grad_key, grad_value
