"""The block quantiser (zeroshard/quantize/blocks.py): round trip within half a step of each element's
block, any size (odd sizes, a last block padded, a block of zeros), the packed layout's byte counts, and
named errors for formats it does not take."""

from __future__ import annotations

import pytest
import torch

from zeroshard.quantize import BlockFormat, QuantisationError, dequantise, pack, packed_bytes, quantise, unpack


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
