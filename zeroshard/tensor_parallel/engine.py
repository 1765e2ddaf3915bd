"""The engine of one tensor-parallel rank: an ordinary engine built with the tensor axis's parts (see
[Note: ZeRO under a model's own tensor parallelism] in tensor_parallel/slices.py)."""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path
from typing import Any, Optional

from torch import nn

from ..config import ZeroshardConfig
from ..distributed.model_parallel import ModelParallelWorlds
from ..distributed.world import release_at_exit
from ..engine.engine import Engine, SchedulerSpec
from ..engine.parts import EngineParts, NormAcross
from .norm import TensorParallelNorm
from .slices import TensorAxis, TensorSlice
from .split import SplitModel


def tensor_parallel_parts(slices: TensorSlice, norm_across: Optional[NormAcross] = None,
                          saves_periodically: bool = True) -> EngineParts:
    """The parts of an engine over a tensor-parallel group: the norm over the group and the rank's slice
    of the model in checkpoints (``norm_across``: a pipeline's norm across its stages on top)."""
    return EngineParts(slices, partial(TensorParallelNorm.over, slices.axis), norm_across, saves_periodically)


def tensor_parallel_engine(model: nn.Module, config: ZeroshardConfig, worlds: ModelParallelWorlds,
                           model_parameters: Any = None, optimizer: Any = None, lr_scheduler: SchedulerSpec = None,
                           split: Optional[SplitModel] = None) -> Engine:
    """The engine of one tensor-parallel rank's part of a model split by its ``mpu``, or by zeroshard
    (``split``: which parameters are split, along which dimension; otherwise the model's marks say
    which are split), over the rank's data-parallel group.  Its periodic saves go to its part of
    ``checkpoint.save_dir``."""
    slices = TensorSlice(TensorAxis(worlds.tensor, worlds.tensor_rank, worlds.dims.tp, split))
    parts = tensor_parallel_parts(slices)
    ckpt = config.checkpoint
    if ckpt.save_dir is not None:  # periodic saves of this rank's part
        config = dataclasses.replace(config, checkpoint=dataclasses.replace(
            ckpt, save_dir=str(slices.own_directory(ckpt.save_dir))))
    engine = Engine(model, config, worlds.data_world, model_parameters, optimizer, lr_scheduler, parts,
                    axes=worlds.dims)
    if ckpt.save_dir is not None:  # periodic saves: how the model is split, beside its parts
        slices.record_split(Path(ckpt.save_dir))
    release_at_exit(slices.release_at_exit)
    return engine
