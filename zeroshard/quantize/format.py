"""The sizes of a block-quantised tensor (no torch needed: the scale model counts with them too): bits per
element, elements per fp32 scale, and the bytes of the packed form (see [Note: symmetric blocks of any
size] in quantize/blocks.py)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockFormat", "QuantisationError", "packed_bytes"]

BITS = (4, 8)
#: bytes of one block's scale (fp32)
SCALE_BYTES = 4


class QuantisationError(ValueError):
    """A block format that cannot be used (bits other than 4 or 8, a block of fewer than one element)."""


@dataclass(frozen=True)
class BlockFormat:
    """How a tensor is quantised: ``bits`` per element (4 or 8), one scale per ``block`` elements."""

    bits: int = 8
    block: int = 4096

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise QuantisationError(f"block quantisation has {self.bits} bits: it takes 4 or 8")
        if self.block < 1:
            raise QuantisationError(f"block quantisation's block size is {self.block}: it takes 1 or more elements")

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def payload_bytes(self, numel: int) -> int:
        """Bytes of the quantised values of ``numel`` elements (the last block's padding is not sent)."""
        return -(-numel * self.bits // 8)

    def scale_bytes(self, numel: int) -> int:
        return self.blocks(numel) * SCALE_BYTES


def packed_bytes(numel: int, fmt: BlockFormat) -> int:
    """Bytes of ``numel`` elements packed (payload, then scales)."""
    return fmt.payload_bytes(numel) + fmt.scale_bytes(numel)


