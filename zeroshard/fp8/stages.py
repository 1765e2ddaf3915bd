"""FP8 layers in a pipeline's stages: one selection over the whole model, each stage converting its own.

[Note: FP8 layers in a pipeline]
A ``PipelineModule`` holds its stage's layers only, under local names (``layers.<j>.<rest>``) that mean
another layer on each stage.  So the selection is made over every stage's linear layers under their
global names (``<layer index>.<rest>``, the names of one ``nn.Sequential`` of every layer, as checkpoints
name them): each rank lists its own, an all-gather over the job gives every rank the whole model's, and
every rank checks the patterns and picks the same layers.  A pattern that matches a layer of another
stage only is then no error, and a pattern that matches nothing is the same error on every rank.  Each
stage swaps its own chosen layers (torchao puts a ``Float8Linear`` holding the same parameters in the
``nn.Linear``'s place), and the module points its calls at the new modules where a layer was itself a
linear.  Tied layers (``TiedLayerSpec``) stay in high precision: their weight is one parameter shared by
stages, kept in step through the module object each tie holds, which a swap would leave behind.

With tensorwise scaling a layer takes its scales from the tensors of each call, and a pipeline's
schedule calls a stage once per micro-batch and pass: a stage quantises as one process running the
same micro-batches one at a time does, whatever the schedule's order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from ..pipeline.module import PipelineModule
from .convert import announce, swap
from .recipes import float8_config
from .selection import LinearShape, Selection, linear_shapes, select

if TYPE_CHECKING:
    from ..config.fp8_block import FP8Config

__all__ = ["convert_stages"]

#: the reason a tied layer stays in high precision
TIED = "a tied layer (TiedLayerSpec), shared by stages"


def convert_stages(module: PipelineModule, block: "FP8Config") -> Selection:
    """The config's ``fp8`` block applied to this rank's stage of a pipeline (see [Note: FP8 layers in a
    pipeline]); collective over the job's ranks."""
    config = float8_config(block.recipe)
    shapes = linear_shapes(module)
    own = [LinearShape(module.global_module_name(s.name), s.in_features, s.out_features) for s in shapes]
    local = {mine.name: s.name for mine, s in zip(own, shapes)}  # global name -> this stage's
    tied = {name for name, mine in local.items() if mine.startswith("tied_modules.")}
    everyone: list[tuple[list[LinearShape], set[str]]] = [([], set())] * module.groups.world.world_size
    dist.all_gather_object(everyone, (own, tied), group=module.groups.world.group)
    linears = {shape.name: shape for listed, _ in everyone for shape in listed}  # each once
    ordered = sorted(linears.values(), key=lambda shape: int(shape.name.partition(".")[0]))  # stable: module order
    kept_tied = {name: TIED for _, names in everyone for name in names}
    selection = select(ordered, tuple(block.include), tuple(block.exclude), block.keep_heads_and_routers,
                       kept_anyway=kept_tied)
    before = list(module.layers)
    swap(module, config, [local[name] for name in selection.converted if name in local])
    module.layers_replaced(before)
    announce(selection, block.recipe)
    return selection

