"""Symmetric block quantisation of a flat tensor: int8, or 4-bit values packed two to a byte, with one
fp32 scale per block of ``block`` elements (the sizes: format.py).

[Note: symmetric blocks of any size]
A tensor of ``n`` elements is cut into ``ceil(n / block)`` blocks; the last one is padded with zeros
for the arithmetic (the padding is never sent), so no size needs to be a multiple of anything
(DeepSpeed's CUDA quantiser asserts multiples of 8 and searches a group count that divides the size).
Each block's scale is its amax over ``qmax`` (127 for 8 bits, 7 for 4 bits: the symmetric range, so
that zero is exact and -qmax..qmax needs no offset), and each element is rounded to the nearest
multiple of the scale: the round trip moves an element by at most half a step (``scale / 2``) of its
own block, which is what bounds the error, and a block of zeros has scale 0 and comes back as zeros.
4-bit values are stored offset by 8 (1..15), two to a byte, the first element in the low nibble.  The
packed form that travels is the payload (``ceil(n bits / 8)`` bytes) followed by the scales' bytes,
``packed_bytes(n)`` bytes in all, so one collective moves both.
"""

from __future__ import annotations

from typing import Optional

import torch

from .format import BlockFormat, packed_bytes

__all__ = ["dequantise", "pack", "quantise", "unpack"]

SCALE = torch.float32  # format.py's SCALE_BYTES


def _blocks_of(values: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """``values`` (1D) as fp32 rows of ``block`` elements, the last padded with zeros."""
    flat = values.reshape(-1).float()
    padded = fmt.blocks(flat.numel()) * fmt.block
    if padded != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
    return flat.view(-1, fmt.block)


def quantise(values: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (any shape, read flat) as (payload: uint8, ``fmt.payload_bytes`` of them; scales: fp32,
    one per block); see [Note: symmetric blocks of any size]."""
    rows = _blocks_of(values, fmt)
    scales = rows.abs().amax(dim=1) / fmt.qmax  # 0 for a block of zeros
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp_(-fmt.qmax, fmt.qmax).to(torch.int8).reshape(-1)
    q = q[: values.numel()]  # the last block's padding is not sent
    if fmt.bits == 8:
        return q.view(torch.uint8), scales
    nibbles = (q + 8).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
    pairs = nibbles.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4), scales


def dequantise(payload: torch.Tensor, scales: torch.Tensor, numel: int, fmt: BlockFormat,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``numel`` values that ``quantise`` gave ``payload`` and ``scales`` for, written into ``out``
    (1D, any float dtype) when given, else returned in fp32."""
    if fmt.bits == 8:
        q = payload.view(torch.int8).float()
    else:
        q = torch.stack([payload & 0xF, payload >> 4], dim=1).reshape(-1).float() - 8
    padded = scales.numel() * fmt.block
    q = torch.cat([q[:numel], q.new_zeros(padded - numel)]) if padded != numel else q[:numel]
    values = (q.view(-1, fmt.block) * scales[:, None]).reshape(-1)[:numel]
    if out is None:
        return values
    out.copy_(values)
    return out


def pack(values: torch.Tensor, fmt: BlockFormat, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``values`` quantised into one uint8 buffer of ``packed_bytes(values.numel())``: payload, then the
    scales' bytes (written into ``out`` when given)."""
    payload, scales = quantise(values, fmt)
    size = packed_bytes(values.numel(), fmt)
    buffer = out if out is not None else torch.empty(size, dtype=torch.uint8, device=values.device)
    buffer[: payload.numel()] = payload
    buffer[payload.numel(): size] = scales.view(torch.uint8)
    return buffer


def unpack(packed: torch.Tensor, numel: int, fmt: BlockFormat, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``numel`` values of a buffer :func:`pack` wrote (into ``out`` when given, else fp32)."""
    split = fmt.payload_bytes(numel)
    scales = packed[split: split + fmt.scale_bytes(numel)].clone().view(SCALE)  # clone: scales need alignment
    return dequantise(packed[:split], scales, numel, fmt, out)
