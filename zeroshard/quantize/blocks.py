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

[Note: quantising in tiles of a kept scratch]
On a CPU the arithmetic is a few cheap passes over memory, and what costs is memory that is new: each
full-size temporary (the fp32 copy, the padded copy, the quotient, the int8 values, the nibbles) is
fresh pages, a page fault each, and a pass that leaves the cache.  So the blocks are quantised a tile
of whole blocks at a time (about ``TILE`` elements) in one fp32 scratch that each thread keeps, and
every result is written where it lives: the int8 values or the nibble pairs straight into the payload,
the dequantised values straight into the destination (any float dtype: the product is formed in fp32
and rounded once into it, as a copy from an fp32 result would round it), a sum into the fp32 buffer it
accumulates in.  The arithmetic is the same operations on the same fp32 values in the same order as
over the whole tensor at once (the amax as the larger of the block's max and -min, both exact; the
quotient by the scale, not a product by its reciprocal), so the bytes are those of the whole-tensor
form, bit for bit, wherever the values are finite.  The nibbles are paired and split by reading two
bytes as one little-endian int16 (the module asserts the byte order at import).  Elsewhere than on a CPU (an allocator that caches, kernels better long) the tile is
the whole tensor.
"""

from __future__ import annotations

import sys
import threading
from typing import Optional

import torch

from .format import BlockFormat, packed_bytes

__all__ = ["dequantise", "pack", "quantise", "unpack"]

SCALE = torch.float32  # format.py's SCALE_BYTES
#: elements quantised at a time on a CPU (see [Note: quantising in tiles of a kept scratch])
TILE = 1 << 18
assert sys.byteorder == "little", "the 4-bit pairing reads two bytes as a little-endian int16"


class _Scratch(threading.local):
    """Each thread's kept CPU scratch buffers, one per dtype (no caller takes one dtype's twice at once),
    grown to the largest tile asked for: about 1.6 MiB at ``TILE`` with blocks of at most ``TILE``."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        buffer = self.buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffers[dtype] = torch.empty(numel, dtype=dtype)
        return buffer[:numel]


_SCRATCH = _Scratch()


def _rows_per_tile(fmt: BlockFormat, blocks: int, device: torch.device) -> int:
    """Blocks per tile: about ``TILE`` elements on a CPU (an even number of them, so that every tile but
    the last starts on a whole byte of nibbles), all of them elsewhere."""
    if device.type != "cpu":
        return max(blocks, 1)
    rows = max(1, TILE // fmt.block)
    return rows + 1 if rows * fmt.block % 2 else rows


def _read_flat(values: torch.Tensor) -> torch.Tensor:
    """``values`` as :func:`_quantise_into` reads them: a 1D view where one exists, as they are where they
    are rows that are each contiguous (a bucket's chunks for one peer: read row by row, not copied), else
    a flat copy."""
    if values.is_contiguous():
        return values.view(-1)
    if values.dim() == 2 and values.stride(1) == 1:
        return values
    return values.reshape(-1)


def _copy_range(values: torch.Tensor, start: int, end: int, into: torch.Tensor) -> None:
    """Copy the elements ``start:end`` of ``values`` read flat (1D, or 2D rows) into ``into``."""
    if values.dim() == 1:
        into.copy_(values[start:end])
        return
    width, at = values.shape[1], start
    while at < end:
        row, column = divmod(at, width)
        take = min(end - at, width - column)
        into[at - start:at - start + take].copy_(values[row, column:column + take])
        at += take


def _quantise_into(flat: torch.Tensor, fmt: BlockFormat, payload: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantise ``flat`` (read by :func:`_read_flat`) into ``payload`` (uint8, ``fmt.payload_bytes``) and
    ``scales`` (fp32, one per block), a tile of whole blocks at a time (see [Note: quantising in tiles of a
    kept scratch])."""
    numel, block, qmax = flat.numel(), fmt.block, fmt.qmax
    blocks = fmt.blocks(numel)
    rows_per_tile = _rows_per_tile(fmt, blocks, flat.device)
    tile = _SCRATCH.get(rows_per_tile * block + 1, torch.float32, flat.device)  # +1: an odd tile's nibble pad
    for first in range(0, blocks, rows_per_tile):
        rows = min(rows_per_tile, blocks - first)
        start, end = first * block, min(numel, (first + rows) * block)
        grid = tile[:rows * block].view(rows, block)
        if flat.dtype == torch.float32 and flat.dim() == 1 and end - start == rows * block:
            source = flat[start:end].view(rows, block)  # already fp32: read in place
        else:
            _copy_range(flat, start, end, tile[:end - start])
            tile[end - start:rows * block].zero_()  # the last block's padding
            source = grid
        amax = torch.maximum(source.amax(dim=1).abs_(), source.amin(dim=1).abs_())
        scale = scales[first:first + rows]
        torch.div(amax, qmax, out=scale)  # 0 for a block of zeros
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        torch.div(source, safe[:, None], out=grid)
        grid.round_().clamp_(-qmax, qmax)
        if fmt.bits == 8:
            payload[start:end].view(torch.int8).copy_(tile[:end - start])
            continue
        pairs = -(-(end - start) // 2)
        if 2 * pairs > rows * block:
            tile[rows * block] = 0  # a tile of an odd number of elements ends on a zero's nibble
        _pair_nibbles(tile[:2 * pairs], payload[start // 2:start // 2 + pairs])


def _pair_nibbles(values: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``values`` (fp32 integers in -7..7, an even number of them) two to a byte into ``out`` (uint8),
    each offset by 8, the first in the low nibble.  Each pair, as int8 bytes ``lo, hi``, is read as one
    little-endian int16, ``(lo mod 256) + 256 hi``, whose ``word - 240 (word >> 8)`` is ``lo + 16 hi``
    modulo 256; the byte wanted, ``(lo + 8) + 16 (hi + 8)``, is that plus 136 (contiguous integer passes,
    where pairing strided bytes is several times slower)."""
    as_bytes = _SCRATCH.get(values.numel(), torch.int8, values.device)
    as_bytes.copy_(values)
    words = as_bytes.view(torch.int16)
    high = _SCRATCH.get(words.numel(), torch.int16, values.device)
    torch.bitwise_right_shift(words, 8, out=high)
    words.sub_(high, alpha=240)
    out.copy_(words).add_(136)  # int16 to uint8 and the sum both modulo 256


def _values_of(payload: torch.Tensor, start: int, end: int, fmt: BlockFormat) -> torch.Tensor:
    """The quantised values of elements ``start:end`` (``start`` even for 4 bits) as int8."""
    if fmt.bits == 8:
        return payload[start:end].view(torch.int8)
    pairs = payload[start // 2:-(-end // 2)]
    values = _SCRATCH.get(2 * pairs.numel(), torch.int8, payload.device)
    words = values.view(torch.int16)  # little-endian: element 2k in the low byte of word k
    high = _SCRATCH.get(pairs.numel(), torch.uint8, payload.device)
    torch.bitwise_right_shift(pairs, 4, out=high)
    words.copy_(pairs)
    words.add_(high, alpha=240)  # lo + 16 hi + 240 hi: lo in the low byte, hi in the high one
    return values[:end - start].sub_(8)


def _dequantise_into(payload: torch.Tensor, scales: torch.Tensor, numel: int, fmt: BlockFormat,
                     out: torch.Tensor, accumulate: bool) -> None:
    """Write (or add, ``accumulate``) the ``numel`` dequantised values into ``out`` (1D), a tile at a time."""
    block = fmt.block
    blocks = fmt.blocks(numel)
    in_place = fmt.bits == 8 and not accumulate  # int8 values times scales into ``out``: no scratch to tile
    rows_per_tile = max(blocks, 1) if in_place else _rows_per_tile(fmt, blocks, payload.device)
    for first in range(0, blocks, rows_per_tile):
        rows = min(rows_per_tile, blocks - first)
        start, end = first * block, min(numel, (first + rows) * block)
        values = _values_of(payload, start, end, fmt)
        full = (end - start) // block  # whole blocks; the last may be short
        pieces = [(0, full * block, values[:full * block].view(full, block), scales[first:first + full, None])]
        if full < rows:
            pieces.append((full * block, end - start, values[full * block:], scales[first + full]))
        for lo, hi, q, scale in pieces:
            if hi == lo:
                continue
            target = out[start + lo:start + hi].view(q.shape)
            if accumulate:
                product = _SCRATCH.get(hi - lo, torch.float32, out.device).view(q.shape)
                target.add_(torch.mul(q, scale, out=product))
            else:
                torch.mul(q, scale, out=target)  # in fp32, rounded once into ``out``'s dtype


def quantise(values: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (any shape, read flat) as (payload: uint8, ``fmt.payload_bytes`` of them; scales: fp32,
    one per block); see [Note: symmetric blocks of any size]."""
    flat = _read_flat(values)
    payload = torch.empty(fmt.payload_bytes(flat.numel()), dtype=torch.uint8, device=flat.device)
    scales = torch.empty(fmt.blocks(flat.numel()), dtype=SCALE, device=flat.device)
    _quantise_into(flat, fmt, payload, scales)
    return payload, scales


def dequantise(payload: torch.Tensor, scales: torch.Tensor, numel: int, fmt: BlockFormat,
               out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """The ``numel`` values that ``quantise`` gave ``payload`` and ``scales`` for, written into ``out``
    (1D, any float dtype) when given, else returned in fp32; ``accumulate``: added to ``out`` instead."""
    if out is None:
        assert not accumulate, "accumulating needs an ``out``"
        out = torch.empty(numel, dtype=torch.float32, device=payload.device)
    if not out.is_contiguous():  # written through a contiguous copy
        flat = out.contiguous()
        _dequantise_into(payload, scales, numel, fmt, flat.view(-1), accumulate)
        return out.copy_(flat.view(out.shape))
    _dequantise_into(payload, scales, numel, fmt, out.view(-1), accumulate)
    return out


def pack(values: torch.Tensor, fmt: BlockFormat, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``values`` quantised into one uint8 buffer of ``packed_bytes(values.numel())``: payload, then the
    scales' bytes (written into ``out`` when given)."""
    flat = _read_flat(values)
    size, split = packed_bytes(flat.numel(), fmt), fmt.payload_bytes(flat.numel())
    buffer = out if out is not None else torch.empty(size, dtype=torch.uint8, device=flat.device)
    scales = torch.empty(fmt.blocks(flat.numel()), dtype=SCALE, device=flat.device)
    _quantise_into(flat, fmt, buffer[:split], scales)
    buffer[split:size] = scales.view(torch.uint8)
    return buffer


def unpack(packed: torch.Tensor, numel: int, fmt: BlockFormat, out: Optional[torch.Tensor] = None,
           accumulate: bool = False) -> torch.Tensor:
    """The ``numel`` values of a buffer :func:`pack` wrote (into ``out`` when given, else fp32; added to
    ``out`` with ``accumulate``)."""
    split = fmt.payload_bytes(numel)
    scales = packed[split: split + fmt.scale_bytes(numel)].clone().view(SCALE)  # clone: scales need alignment
    return dequantise(packed[:split], scales, numel, fmt, out, accumulate)
