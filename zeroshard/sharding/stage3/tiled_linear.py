"""``TiledLinear``: one linear layer as a grid of smaller ones, so stage 3 never gathers it whole.

    proj = TiledLinear(8192, 32768, in_splits=4, out_splits=4)   # 16 tiles of 2048 x 8192

A huge projection (a vocabulary head, a wide MLP) is one parameter, and stage 3 gathers a parameter
whole before its module runs.  Cut into ``out_splits`` x ``in_splits`` tiles, each tile is a module
of its own: the layer computes tile by tile, so only the tiles in use need be gathered and the peak is
a tile, not the layer.  Tile ``[o][i]`` holds rows ``out_parts[o]:out_parts[o+1]`` and columns
``in_parts[i]:in_parts[i+1]`` of the full weight (the parts as even as the sizes allow, the first
ones one larger); the input is cut along its last dimension at ``in_parts``, tile ``[o][i]`` maps
input part ``i`` to output part ``o``, the ``in_splits`` results of a row are summed and the rows
joined.  Only the last tile of each row has a bias (the row's slice of the full bias), so it is
added once.  The result equals the full layer's up to the order of the additions.

Fewer tiles are faster: small matrix products use the device less well, and each tile is a gather.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from .gathered import GatheredParameters


class TileCountError(RuntimeError, ValueError):
    """A number of tiles outside ``[1, features]`` (a RuntimeError, as DeepSpeed raises it)."""


def even_parts(num_items: int, num_parts: int) -> list[int]:
    """``num_parts + 1`` bounds cutting ``num_items`` into parts whose sizes differ by at most one
    (the first ``num_items % num_parts`` parts one larger)."""
    size, larger = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + size + (1 if part < larger else 0))
    return bounds


class TiledLinear(nn.Module):
    """A drop-in for ``nn.Linear(in_features, out_features, bias)`` made of ``out_splits`` x
    ``in_splits`` tiles (``linear_cls`` modules, built with ``**kwargs``; see the module's doc).

    ``input_is_already_split``: ``forward`` receives the ``in_splits`` input parts as a sequence;
    ``combine_out_splits=False``: it returns the ``out_splits`` output parts as a list instead of
    joining them; ``init_linear``: a full layer whose values the tiles copy.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: type = nn.Linear, init_linear: Optional[nn.Module] = None, **kwargs: Any) -> None:
        super().__init__()
        for name, splits, features in (("in_splits", in_splits, in_features), ("out_splits", out_splits,
                                                                                out_features)):
            if not 1 <= splits <= features:
                raise TileCountError(f"{name}={splits}: the number of tiles must be in [1, {features}] (one tile "
                                     f"needs at least one feature)")
        self.in_features, self.out_features = in_features, out_features
        self.use_bias = bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = even_parts(in_features, in_splits)
        self.out_parts = even_parts(out_features, out_splits)
        self.linears = nn.ModuleList(
            nn.ModuleList(linear_cls(self.in_parts[i + 1] - self.in_parts[i], self.out_parts[o + 1] - self.out_parts[o],
                                     bias=bias and i == in_splits - 1, **kwargs)
                          for i in range(in_splits))
            for o in range(out_splits))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def tile(self, out_id: int, in_id: int) -> nn.Module:
        """Tile ``[out_id][in_id]``: rows ``out_parts[out_id]:...`` and columns ``in_parts[in_id]:...``."""
        row = self.linears[out_id]
        assert isinstance(row, nn.ModuleList)
        return row[in_id]

    def forward(self, input_: Any) -> Any:
        inputs = self._input_parts(input_)
        outputs: list[Any] = []
        for o in range(self.out_splits):
            summed = None
            for i in range(self.in_splits):
                summed = self._reduce_local_output(i, o, summed, self.tile(o, i)(inputs[i]))
            outputs.append(summed)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _input_parts(self, input_: Any) -> Sequence[Any]:
        if self.in_splits == 1:
            return [input_]
        if self.input_is_already_split:
            if len(input_) != self.in_splits:
                raise TileCountError(f"forward got {len(input_)} input parts for in_splits={self.in_splits}")
            return input_
        return self._split_global_input(input_, [b - a for a, b in zip(self.in_parts, self.in_parts[1:])])

    def _split_global_input(self, input_: torch.Tensor, split_sizes: list[int]) -> Sequence[Any]:
        """The input cut along its last dimension into ``split_sizes`` (views; a subclass taking other
        input types overrides this)."""
        return torch.split(input_, split_sizes, dim=-1)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """Add tile ``[out_id][in_id]``'s result to its row's sum so far (None before the first)."""
        # a new tensor, never the tile's output itself: the sum must not alias what autograd saved
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        """The rows' results joined along the last dimension."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy a full layer's weight (and bias) into the tiles.  Under stage 3 it is collective:
        every rank calls it and every rank's tiles end with rank 0's values."""
        weight, other_bias = getattr(other, "weight", None), getattr(other, "bias", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"copy_params_from: {type(other).__name__} has no weight to copy")
        expected = (self.out_features, self.in_features)
        if self.use_bias != (other_bias is not None):
            raise ValueError(f"copy_params_from: this TiledLinear has bias={self.use_bias}, the layer given "
                             f"{'has' if other_bias is not None else 'has no'} bias")
        with GatheredParameters([p for p in (weight, other_bias) if isinstance(p, nn.Parameter)]):
            if tuple(weight.shape) != expected:
                raise ValueError(f"copy_params_from: weight of shape {tuple(weight.shape)}, expected {expected}")
            if other_bias is not None and tuple(other_bias.shape) != (self.out_features,):
                raise ValueError(f"copy_params_from: bias of shape {tuple(other_bias.shape)}, expected "
                                 f"({self.out_features},)")
            for o in range(self.out_splits):
                rows = slice(self.out_parts[o], self.out_parts[o + 1])
                for i in range(self.in_splits):
                    columns = slice(self.in_parts[i], self.in_parts[i + 1])
                    tile = self.tile(o, i)
                    tile_weight, tile_bias = getattr(tile, "weight"), getattr(tile, "bias", None)
                    with GatheredParameters(list(tile.parameters(recurse=False)), modifier_rank=0):
                        tile_weight.copy_(weight[rows, columns])
                        if tile_bias is not None:
                            assert other_bias is not None
                            tile_bias.copy_(other_bias[rows])


class TiledLinearReturnBias(TiledLinear):
    """Tiles that return ``(output, bias)`` and leave the bias to the caller (Megatron's linears, which
    fuse the addition into a later kernel): the rows' outputs are summed and joined, and the rows'
    biases joined."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        if not (isinstance(new_out, tuple) and len(new_out) == 2 and new_out[0] is not None):
            raise TypeError(f"tile [{out_id}][{in_id}] returned {type(new_out).__name__}: a "
                            f"TiledLinearReturnBias tile returns (output, bias)")
        summed, bias = current_out if current_out is not None else (None, None)
        tensor, new_bias = new_out
        return super()._reduce_local_output(in_id, out_id, summed, tensor), new_bias if new_bias is not None else bias

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        biases = [bias for _, bias in outputs if bias is not None]
        return (super()._combine_output_splits([tensor for tensor, _ in outputs]),
                super()._combine_output_splits(biases) if biases else None)
