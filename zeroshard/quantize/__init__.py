"""Block quantisation of flat tensors for communication (ZeRO++'s qwZ and qgZ): symmetric int8 or
packed 4-bit values with one fp32 scale per block (blocks.py), and their sizes (format.py)."""

from .blocks import dequantise, pack, quantise, unpack
from .format import BlockFormat, QuantisationError, packed_bytes

__all__ = ["BlockFormat", "QuantisationError", "dequantise", "pack", "packed_bytes", "quantise", "unpack"]
