"""Block quantisation of flat tensors for communication (ZeRO++'s qwZ and qgZ): symmetric int8 or
packed 4-bit values with one fp32 scale per block (blocks.py), and their sizes (format.py); int8 in a
number of equal groups, DeepSpeed's quantiser interface (groups.py)."""

from .blocks import dequantise, pack, quantise, unpack
from .format import BlockFormat, QuantisationError, packed_bytes
from .groups import dequantise_groups, group_count, quantise_groups

__all__ = ["BlockFormat", "QuantisationError", "dequantise", "pack", "packed_bytes", "quantise", "unpack",
           "quantise_groups", "dequantise_groups", "group_count"]
