"""ZeRO++'s quantised communication in the scale model: qwZ's int8 parameter gathers and qgZ's two
all-to-alls of quantised gradients, counted as the engine counts them (sharding/stage3/quantised_gathers.py,
sharding/quantised_reduction.py).

[Note: quantised bytes in the scale model]
A qwZ gather of a bucket of Ψ_b elements over G ranks moves G packed chunks of Ψ_b/G int8 elements and
one fp32 scale per block of each: the ring sends (G-1) of them.  It applies to stage 3's gathers over the
shard group (with hpZ, the first forward's; the secondary partition's stay in the compute dtype).  A qgZ
reduction of a bucket over N = M x L ranks (M nodes of L) replaces the reduce-scatter: inside the node
each rank sends (L-1) packed pieces of M chunks, across nodes (M-1) packed chunks, at 4 or 8 bits per
element plus the scales.  The scale model places the shard group on nodes as it places every group
(``group_placement``): L is its ranks on a node, M = N / L.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..quantize.format import BlockFormat, packed_bytes

__all__ = ["Quantisation"]


@dataclass(frozen=True)
class Quantisation:
    """Which of ZeRO++'s quantised collectives a job uses (see [Note: quantised bytes in the scale model])."""

    weights: bool = False                  # qwZ: stage 3's gathers for compute as int8 blocks
    gradient_bits: Optional[int] = None    # qgZ: 4 or 8 bits per gradient element (None: off)
    block: int = 4096                      # elements per fp32 scale

    @classmethod
    def from_zero_config(cls, zero: Any) -> Optional["Quantisation"]:
        """The config's ``zero_optimization`` block's quantisation (None: neither qwZ nor qgZ)."""
        if not (zero.zero_quantized_weights or zero.zero_quantized_gradients):
            return None
        return cls(bool(zero.zero_quantized_weights),
                   zero.zero_quantized_gradients_bits if zero.zero_quantized_gradients else None,
                   zero.zero_quantized_block_size)

    def describe(self) -> str:
        parts = (["qwZ int8"] if self.weights else []) + (
            [f"qgZ {self.gradient_bits}-bit"] if self.gradient_bits is not None else [])
        return " + ".join(parts) + f", blocks of {self.block}"

    def gather_full_bytes(self, numel: int, group: int) -> int:
        """The full bytes of a qwZ gather of ``numel`` (padded) elements over ``group`` ranks."""
        return group * packed_bytes(numel // group, BlockFormat(8, self.block))

    def hop_full_bytes(self, numel: int, local: int, nodes: int) -> tuple[int, int]:
        """Each rank's input bytes of qgZ's two all-to-alls (inside the node, across nodes) for a bucket of
        ``numel`` (padded) elements over ``nodes`` x ``local`` ranks; 0 for a hop of one rank."""
        assert self.gradient_bits is not None
        fmt, shard = BlockFormat(self.gradient_bits, self.block), numel // (local * nodes)
        inside = local * packed_bytes(nodes * shard, fmt) if local > 1 else 0
        across = nodes * packed_bytes(shard, fmt) if nodes > 1 else 0
        return inside, across
