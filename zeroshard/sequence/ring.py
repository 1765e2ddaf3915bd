"""Ring attention: attention over sequences split across a sequence-parallel group without a head split.

Each rank of a group of P ranks holds the queries, keys and values of its slice of every sequence.  The
key/value blocks travel round the ring of the group (rank r sends to r + 1 and receives from r - 1), so
that after P - 1 steps every rank's queries have met every block; each block's attention is merged into
the running result with its log-sum-exp (an online softmax), which is exact.  The running result and the
log-sum-exps are fp32 whatever the inputs' dtype (as flash attention keeps its accumulator), so the
merges of a 16-bit ring add no rounding to each block's.  Nothing is split by heads, so any head count
runs at any degree.

[Note: the ring's backward runs the ring again]
The forward keeps only its inputs, its output and the log-sum-exp of every query row; the backward
recomputes each block's probabilities from them (``exp(scores - lse)``), as flash attention does.  The
key/value blocks travel round the ring once more, each with the gradients of its keys and values
accumulated so far: every rank adds its queries' share, and after P steps a block's gradients are back
at the rank that owns it.  The queries' gradient stays where the queries are, summed block by block.
Under a causal mask, blocks wholly in the future of a rank's queries (those from higher ranks of the
group, in the consecutive layout) are passed on without being computed; the messages are the same on
every rank, so the ranks agree on every message of the group.

[Note: each pair on the fused kernel]
On the CPU each chunk pair runs on torch's fused attention kernel (the one ``scaled_dot_product_attention``
calls there), which returns the log-sum-exp the merge needs; its backward, handed the whole rows' output
and log-sum-exp, gives exactly the pair's share of the gradients.  Grouped key/value heads are expanded to
the query heads for the kernel and their gradients summed back.  Elsewhere (and for a value head size
unlike the key's) the pair runs as plain matmul, mask and softmax, the same arithmetic unfused.

[Note: head-tail sharding balances the causal ring]
In the consecutive layout, rank r's queries see r + 1 of the P blocks, so under a causal mask the last
rank computes P blocks while the first computes one, and every step of the ring waits for the slowest.
With ``balanced`` the sequence is cut into 2P chunks and rank r holds chunks r and 2P - 1 - r (an early
chunk and its mirror from the end): against another rank's block exactly two of the four chunk pairs
are visible (its early chunk sees the lower rank's early chunk, its late chunk the other's early chunk,
or the other's late chunk when the other rank is higher), and against its own block three, so every
rank computes the same amount at every step.  Attention is computed chunk pair by chunk pair, each
query chunk's softmax merged on its own; the data must be cut the same way (``sequence_positions``).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from ..distributed.collectives import Collectives, PendingCollective

__all__ = ["ring_attention", "sequence_positions"]


def sequence_positions(length: int, rank: int, size: int, balanced: bool = False) -> Tensor:
    """The positions of a sequence of ``length`` that rank ``rank`` of a ring of ``size`` holds, in the
    order it holds them: the ``rank``-th consecutive slice, or with ``balanced`` chunks ``rank`` and
    ``2 size - 1 - rank`` of ``2 size`` ([Note: head-tail sharding balances the causal ring])."""
    parts = 2 * size if balanced else size
    if length % parts:
        raise ValueError(f"a sequence of {length} positions does not cut into {parts} equal chunks")
    chunk = length // parts
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in _chunks(rank, size, balanced)])


def ring_attention(comm: Collectives, query: Tensor, key: Tensor, value: Tensor, causal: bool,
                   balanced: bool = False, scale: Optional[float] = None) -> Tensor:
    """``softmax(query key^T x scale) value`` over the whole sequences, each rank of ``comm``
    holding its slice: ``query`` ``[b, heads, s/P, d]``, ``key`` and ``value`` ``[b, kv_heads, s/P, d]``
    (``kv_heads`` dividing ``heads``: consecutive query heads share a key/value head); returns ``[b, heads,
    s/P, value's d]``.  ``causal``: a position attends only to itself and the positions before it,
    positions counted over the whole sequence: rank r's slice is the r-th, or with ``balanced`` the
    positions ``sequence_positions`` gives.  ``scale``: None is ``1 / sqrt(head_dim)``.  Differentiable; the
    bytes are counted in ``comm``'s ledger as ``sequence_ring_kv`` (``sequence_ring_kv_grad`` in the backward)."""
    return _RingAttention.apply(comm, causal, balanced, scale, query, key, value)


def _chunks(rank: int, size: int, balanced: bool) -> list[int]:
    """The chunks of the sequence rank ``rank`` holds, in order (of ``2 size`` with ``balanced``)."""
    return [rank, 2 * size - 1 - rank] if balanced else [rank]


def _grouped(query: Tensor, kv_heads: int) -> Tensor:
    """``[b, heads, s, d]`` as ``[b, kv_heads, heads / kv_heads, s, d]``: each key/value head's queries."""
    return query.unflatten(1, (kv_heads, -1))


def _wide(t: Tensor) -> Tensor:
    """``t`` in fp32, or as it is where it is wider: the dtype of the merge and the log-sum-exps."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _pack(*tensors: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: Tensor, like: tuple[Tensor, ...]) -> list[Tensor]:
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in like]), like)]


def _scores(q: Tensor, k: Tensor, scale: float, diagonal: bool) -> Tensor:
    """``q`` ``[b, hk, g, sq, d]`` against ``k`` ``[b, hk, sk, d]``: ``[b, hk, g, sq, sk]``, the future
    masked out on a diagonal pair (the same positions on both sides)."""
    scores = q @ k.unsqueeze(2).transpose(-1, -2) * scale
    if diagonal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _fused(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a pair runs on torch's fused CPU attention kernel ([Note: each pair on the fused kernel])."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and k.shape[-1] == v.shape[-1]


def _heads(t: Tensor, groups: int) -> Tensor:
    """``[b, hk, s, d]`` as ``[b, hk * groups, s, d]``: each key/value head once for each of its queries."""
    b, hk, s, d = t.shape
    return t.unsqueeze(2).expand(b, hk, groups, s, d).reshape(b, hk * groups, s, d)


def _pair_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, diagonal: bool) -> tuple[Tensor, Tensor]:
    """One chunk pair's attention and log-sum-exp: ``q`` ``[b, hk, g, sq, d]`` against ``k``, ``v`` ``[b,
    hk, sk, d]``; ``[b, hk, g, sq, dv]`` (the inputs' dtype) and ``[b, hk, g, sq, 1]`` (at least fp32), the future
    masked on a diagonal pair."""
    if _fused(q, k, v):
        b, hk, g, sq, d = q.shape
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.reshape(b, hk * g, sq, d), _heads(k, g), _heads(v, g), 0.0, diagonal, scale=scale)
        return out.view(b, hk, g, sq, -1), _wide(lse.view(b, hk, g, sq, 1))
    scores = _wide(_scores(q, k, scale, diagonal))
    lse = scores.logsumexp(-1, keepdim=True)  # finite: every row of a pair sees a key
    return torch.exp(scores - lse).to(q.dtype) @ v.unsqueeze(2), lse


def _pair_backward(grad_o: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, delta: Tensor,
                   scale: float, diagonal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk pair's share of the gradients of ``q``, ``k`` and ``v``, its probabilities recomputed
    against the whole rows' ``lse`` (and ``out``, ``delta``: rowsum(dO * O))."""
    if _fused(q, k, v):
        b, hk, g, sq, d = q.shape
        grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_o.reshape(b, hk * g, sq, -1), q.reshape(b, hk * g, sq, d), _heads(k, g), _heads(v, g),
            out.reshape(b, hk * g, sq, -1), lse.reshape(b, hk * g, sq).float(), 0.0, diagonal, scale=scale)
        return (grad_q.view(q.shape), grad_k.unflatten(1, (hk, g)).sum(2), grad_v.unflatten(1, (hk, g)).sum(2))
    probs = torch.exp(_wide(_scores(q, k, scale, diagonal)) - lse).to(q.dtype)
    grad_v = (probs.transpose(-1, -2) @ grad_o).sum(2)
    grad_scores = probs * (grad_o @ v.unsqueeze(2).transpose(-1, -2) - delta) * scale
    return grad_scores @ k.unsqueeze(2), (grad_scores.transpose(-1, -2) @ q).sum(2), grad_v


class _Ring:
    """The blocks' journey round the group: who holds which block at each step, which chunk pairs of
    it this rank's queries see, and the messages."""

    def __init__(self, comm: Collectives, causal: bool, balanced: bool) -> None:
        self.comm, self.causal, self.balanced = comm, causal, balanced
        self.size, self.rank = comm.world.world_size, comm.world.rank
        self.parts = 2 if balanced else 1

    def pairs(self, step: int) -> list[tuple[int, int, bool]]:
        """The chunk pairs computed at ``step``: (this rank's query chunk, the held block's key chunk,
        whether the pair is on the diagonal and masked), the pairs wholly in the future left out."""
        owner = (self.rank - step) % self.size  # its own block at step 0
        mine, theirs = _chunks(self.rank, self.size, self.balanced), _chunks(owner, self.size, self.balanced)
        return [(i, j, self.causal and key_chunk == query_chunk)
                for i, query_chunk in enumerate(mine) for j, key_chunk in enumerate(theirs)
                if not self.causal or key_chunk <= query_chunk]

    def split(self, t: Tensor) -> tuple[Tensor, ...]:
        """``t``'s chunks along the sequence (views)."""
        return t.chunk(self.parts, dim=-2)

    def send_on(self, block: Tensor, label: str) -> tuple[Tensor, PendingCollective]:
        incoming = torch.empty_like(block)
        return incoming, self.comm.send_recv(block, incoming, label, async_op=True)


class _RingAttention(torch.autograd.Function):
    """The ring's forward and backward ([Note: the ring's backward runs the ring again])."""

    @staticmethod
    def forward(ctx: Any, comm: Collectives, causal: bool, balanced: bool,  # type: ignore[override]
                scale: Optional[float], query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        ring = _Ring(comm, causal, balanced)
        q = ring.split(_grouped(query, key.shape[1]))
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        block = _pack(key, value)
        outs: list[Optional[Tensor]] = [None] * ring.parts
        lses: list[Optional[Tensor]] = [None] * ring.parts
        for step in range(ring.size):
            # the next block is on its way while this one is computed
            incoming, pending = ring.send_on(block, "sequence_ring_kv") if step < ring.size - 1 else (None, None)
            k, v = (ring.split(t) for t in _unpack(block, (key, value)))
            for i, j, diagonal in ring.pairs(step):
                pair_out, pair_lse = _pair_forward(q[i], k[j], v[j], scale, diagonal)
                out, lse = outs[i], lses[i]
                if out is None or lse is None:  # the first pair of this query chunk
                    outs[i], lses[i] = _wide(pair_out), pair_lse
                else:
                    merged = torch.logaddexp(lse, pair_lse)
                    outs[i] = out * torch.exp(lse - merged) + _wide(pair_out) * torch.exp(pair_lse - merged)
                    lses[i] = merged
            if pending is not None and incoming is not None:
                pending.wait()
                block = incoming
        # every query chunk met its own chunk at step 0
        out_all = torch.cat([o for o in outs if o is not None], dim=-2).to(query.dtype)
        lse_all = torch.cat([lse for lse in lses if lse is not None], dim=-2)
        ctx.comm, ctx.causal, ctx.balanced, ctx.scale = comm, causal, balanced, scale
        ctx.save_for_backward(query, key, value, out_all, lse_all)
        return out_all.flatten(1, 2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.comm, ctx.causal, ctx.balanced)
        grouped, grad_out = _grouped(query, key.shape[1]), _grouped(grad, key.shape[1])
        delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O): the softmax's backward
        grad_query = torch.zeros_like(grouped)
        q, grad_q, grad_o, out_q, lse_q, delta_q = (ring.split(t) for t in (grouped, grad_query, grad_out, out, lse,
                                                                             delta))
        like = (key, value, key, value)
        block = _pack(key, value, torch.zeros_like(key), torch.zeros_like(value))
        for step in range(ring.size):
            k, v, grad_k, grad_v = (ring.split(t) for t in _unpack(block, like))
            for i, j, diagonal in ring.pairs(step):
                pair_q, pair_k, pair_v = _pair_backward(grad_o[i], q[i], k[j], v[j], out_q[i], lse_q[i], delta_q[i],
                                                        ctx.scale, diagonal)
                grad_q[i].add_(pair_q)
                grad_k[j].add_(pair_k)
                grad_v[j].add_(pair_v)
            if step == ring.size - 1:  # the gradients alone go on once more, to the block's owner
                block = block[key.numel() + value.numel():]
            block, pending = ring.send_on(block, "sequence_ring_kv_grad")
            pending.wait()
        grad_key, grad_value = _unpack(block, (key, value))
        return None, None, None, None, grad_query.flatten(1, 2), grad_key, grad_value
