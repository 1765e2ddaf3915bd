"""The block quantiser (zeroshard/quantize/blocks.py): round trip within half a step of each element's
block, any size (odd sizes, a last block padded, a block of zeros), the packed layout's byte counts, the
tiled arithmetic bit for bit the whole-tensor arithmetic of the note, and named errors for formats it
does not take."""

from __future__ import annotations

import pytest
import torch

from zeroshard.quantize import BlockFormat, QuantisationError, blocks, dequantise, pack, packed_bytes, quantise, unpack


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,block", [(1, 1), (7, 4), (1000, 64), (1001, 64), (4099, 4096), (33, 5)])
def test_round_trip_within_half_a_step(bits: int, numel: int, block: int) -> None:
    fmt = BlockFormat(bits, block)
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    values[numel // 2] = 0.0
    payload, scales = quantise(values, fmt)
    assert payload.dtype == torch.uint8 and payload.numel() == fmt.payload_bytes(numel)
    assert scales.numel() == fmt.blocks(numel)
    back = dequantise(payload, scales, numel, fmt)
    step = scales.repeat_interleave(block)[:numel]  # each element's own block's scale
    assert torch.all((back - values).abs() <= step / 2 * (1 + 1e-6) + 1e-12)
    assert torch.equal(scales, torch.stack([b.abs().max() for b in values.split(block)]) / fmt.qmax)
    # packed: payload then scales, the same values back, into a tensor of another dtype too
    packed = pack(values, fmt)
    assert packed.numel() == packed_bytes(numel, fmt) == fmt.payload_bytes(numel) + 4 * fmt.blocks(numel)
    assert torch.equal(unpack(packed, numel, fmt), back)
    out = torch.empty(numel, dtype=torch.bfloat16)
    assert torch.equal(unpack(packed, numel, fmt, out), back.to(torch.bfloat16))


def test_sizes_and_exact_values() -> None:
    assert BlockFormat(8, 4096).payload_bytes(4097) == 4097  # the last block's padding is not sent
    assert BlockFormat(8, 4096).scale_bytes(4097) == 8  # but it has its scale
    assert BlockFormat(4, 3).payload_bytes(5) == 3  # five nibbles in three bytes
    assert BlockFormat(4, 5).payload_bytes(6) == 3
    zeros = torch.zeros(10)
    payload, scales = quantise(zeros, BlockFormat(4, 4))
    assert torch.equal(scales, torch.zeros(3)) and torch.equal(dequantise(payload, scales, 10, BlockFormat(4, 4)), zeros)
    exact = torch.tensor([-7.0, -1.0, 0.0, 3.0, 7.0])  # multiples of the scale come back exactly
    assert torch.equal(unpack(pack(exact, BlockFormat(4, 5)), 5, BlockFormat(4, 5)), exact)
    exact8 = torch.arange(-127, 128, dtype=torch.float32)
    assert torch.equal(unpack(pack(exact8, BlockFormat(8, 255)), 255, BlockFormat(8, 255)), exact8)


@pytest.mark.parametrize("bits,block,words", [(3, 64, "3 bits: it takes 4 or 8"), (8, 0, "block size is 0")])
def test_bad_formats_are_named(bits: int, block: int, words: str) -> None:
    with pytest.raises(QuantisationError, match=words):
        BlockFormat(bits, block)


def whole_tensor_pack(values: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """[Note: symmetric blocks of any size] over the whole tensor at once: the oracle of the tiled form."""
    flat = values.reshape(-1).float()
    rows = torch.cat([flat, flat.new_zeros(fmt.blocks(flat.numel()) * fmt.block - flat.numel())]).view(-1, fmt.block)
    scales = rows.abs().amax(dim=1) / fmt.qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp_(-fmt.qmax, fmt.qmax).to(torch.int8).reshape(-1)[:flat.numel()]
    if fmt.bits == 8:
        payload = q.view(torch.uint8)
    else:
        nibbles = torch.cat([(q + 8).to(torch.uint8), torch.full((q.numel() % 2,), 8, dtype=torch.uint8)]).view(-1, 2)
        payload = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return torch.cat([payload, scales.view(torch.uint8)])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,block,tile", [(1001, 64, 64), (1001, 7, 20), (4099, 4096, 64), (5000, 33, 200)])
def test_tiles_give_the_whole_tensors_bytes(bits: int, numel: int, block: int, tile: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of a few blocks (an odd number of elements too) give the bytes of the arithmetic over the whole
    tensor, from bf16, fp32 (read in place) and strided fp32, and back: the values, and a sum into fp32."""
    monkeypatch.setattr(blocks, "TILE", tile)
    fmt = BlockFormat(bits, block)
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    values[:block] = 0.0  # a block of zeros
    for source in (values, values.to(torch.bfloat16), torch.stack([values, values], dim=1)[:, 0]):
        packed = pack(source, fmt)
        assert torch.equal(packed, whole_tensor_pack(source, fmt))
        split = fmt.payload_bytes(numel)
        scales = packed[split:].clone().view(torch.float32)
        exact = _whole_tensor_values(quantise(source, fmt)[0], scales, numel, fmt)
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(unpack(packed, numel, fmt, torch.empty(numel, dtype=dtype)), exact.to(dtype))
        base = torch.randn(numel)
        assert torch.equal(unpack(packed, numel, fmt, base.clone(), accumulate=True), base + exact)
        strided = torch.zeros(numel, 2)[:, 0]  # a destination that is not contiguous
        assert torch.equal(unpack(packed, numel, fmt, strided, accumulate=True), exact)


def _whole_tensor_values(payload: torch.Tensor, scales: torch.Tensor, numel: int, fmt: BlockFormat) -> torch.Tensor:
    if fmt.bits == 8:
        q = payload.view(torch.int8).float()
    else:
        q = torch.stack([payload & 0xF, payload >> 4], dim=1).reshape(-1).float()[:numel] - 8
    q = torch.cat([q, q.new_zeros(scales.numel() * fmt.block - numel)])
    return (q.view(-1, fmt.block) * scales[:, None]).reshape(-1)[:numel]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [7, 64])
def test_rows_of_a_wider_tensor_are_read_in_place(bits: int, block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2D view whose rows are contiguous but not adjacent (qgZ's chunks for one peer) packs as its flat
    copy would, tiles straddling its rows."""
    monkeypatch.setattr(blocks, "TILE", 64)
    holder = torch.randn(3, 2, 1001, generator=torch.Generator().manual_seed(block)).to(torch.bfloat16)
    rows = holder[:, 1, :]
    assert not rows.is_contiguous() and rows.stride(1) == 1
    fmt = BlockFormat(bits, block)
    assert torch.equal(pack(rows, fmt), whole_tensor_pack(rows.reshape(-1), fmt))
def test_equal_groups_and_deepspeeds_quantizer() -> None:
    from zeroshard.deepspeed.runtime.zero.partition_parameters import CUDAQuantizer
    from zeroshard.quantize import dequantise_groups, group_count, quantise_groups

    assert (group_count(4096), group_count(16_002), group_count(8009)) == (1, 3, 8009)  # 8009 is prime
    values = torch.randn(12, 20, generator=torch.Generator().manual_seed(3))
    q, scales = quantise_groups(values, groups=6)
    assert q.dtype == torch.int8 and q.numel() == 240 and scales.numel() == 6
    back = dequantise_groups(q, scales, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    step = scales.repeat_interleave(40)
    assert torch.all((dequantise_groups(q, scales) - values.reshape(-1)).abs() <= step / 2 * (1 + 1e-6))
    with pytest.raises(QuantisationError, match="equal groups"):
        quantise_groups(values, groups=7)
    quantizer = CUDAQuantizer()  # no DeepSpeed op: zeroshard's own quantiser, in the dtype asked for
    q, scales = quantizer.quantize(values.bfloat16())
    assert q.dtype == torch.int8 and scales.numel() == 1
    again = quantizer.dequantize(q, scales, dtype=torch.bfloat16)
    assert again.dtype == torch.bfloat16 and torch.equal(again, dequantise_groups(q, scales, torch.bfloat16))
    assert quantizer.dequantize(q, scales).dtype == torch.half
