"""Tensor parallelism from the config (DeepSpeed's AutoTP): a model's linear layers split over groups
of neighbouring ranks with torch's DTensor, ZeRO over each tensor-parallel rank's data-parallel group
(docs/TENSOR_PARALLEL.md)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from ..config.schema import TensorParallelConfig
from ..distributed.collectives import Collectives
from ..distributed.model_parallel import ModelParallelWorlds, model_parallel_worlds
from ..distributed.parallel_dims import ParallelDims
from ..distributed.world import World, init_distributed
from ..logging import log_rank
from .batch_check import TensorParallelBatchError, check_batches
from .groups import TensorParallelGroups, TensorParallelSizeError
from .plan import TensorPlan, TensorPlanError, plan_linears
from .split import SplitModel, split_model, split_of

__all__ = ["TensorParallelBatchError", "TensorParallelGroups", "TensorParallelSizeError", "TensorPlan",
           "TensorPlanError", "SplitModel", "split_of", "tp_model_init", "prepare_tensor_parallel", "split_stage",
           "tensor_parallel_size"]


def _split(model: nn.Module, block: TensorParallelConfig, axes: ParallelDims, rank: int,
           device: torch.device) -> SplitModel:
    groups = TensorParallelGroups(axes, rank, device)
    plan = plan_linears(model, block)
    record = split_model(model, plan, groups)
    log_rank(plan.describe(block.autotp_size))
    return record


def tp_model_init(model: nn.Module, tp_size: int, dtype: Optional[torch.dtype] = None, config: Any = None,
                  **kwargs: Any) -> nn.Module:
    """DeepSpeed's ``deepspeed.tp_model_init``: split ``model`` over groups of ``tp_size`` ranks now (the
    default plan, or ``config``'s ``tensor_parallel`` block), cast to ``dtype``; ``initialize()`` then
    trains it as split.  Every rank calls it, after the process group exists."""
    from ..config import load_config

    if kwargs:
        raise TypeError(f"tp_model_init() got unexpected arguments {sorted(kwargs)}")
    block = load_config(config).tensor_parallel if config is not None else TensorParallelConfig()
    if block.autotp_size not in (0, 1, tp_size):
        raise TensorParallelSizeError(f"tp_model_init(tp_size={tp_size}) but the config says "
                                      f"tensor_parallel.autotp_size = {block.autotp_size}")
    block = TensorParallelConfig(tp_size, block.partition_config, block.preset_model, block.tp_overlap_comm)
    if dtype is not None:
        model.to(dtype)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    world = init_distributed()
    _split(model, block, ParallelDims.for_job(world.world_size, tp=tp_size), world.rank, device)
    return model


def tensor_parallel_size(model: nn.Module, block: TensorParallelConfig) -> int:
    """The tensor axis's size of a job training ``model``: how ``tp_model_init`` split it, else the
    config's ``autotp_size`` (1: none); a split that contradicts the config is refused."""
    record = split_of(model)
    if record is not None and block.autotp_size > 1 and block.autotp_size != record.size:
        raise TensorParallelSizeError(f"the model was split over {record.size} ranks by tp_model_init(), but the "
                                      f"config says tensor_parallel.autotp_size = {block.autotp_size}")
    return record.size if record is not None else max(block.autotp_size, 1)


def prepare_tensor_parallel(model: nn.Module, block: TensorParallelConfig, world: World, axes: ParallelDims
                            ) -> Optional[tuple[ModelParallelWorlds, TensorParallelGroups, SplitModel, Any]]:
    """For ``initialize()``: the model split over the tensor axis of ``axes``, the job's axes (now, or by
    ``tp_model_init`` before), the worlds its engine trains over (their ``dims``: ``axes``), and the
    batch check's hook (the engine removes it); None when the job has no tensor parallelism from the
    config."""
    record = split_of(model)
    if record is None and axes.tp == 1:
        return None
    if record is None:
        record = _split(model, block, axes, world.rank, world.device)
    worlds = dataclasses.replace(model_parallel_worlds(record.groups, world), dims=axes)
    hook = check_batches(model, Collectives(world), record.size)
    return worlds, record.groups, record, hook


def split_stage(stage: nn.Module, block: TensorParallelConfig, groups: Any) -> SplitModel:
    """A pipeline stage's layers split over its tensor-parallel group (``groups``: the pipeline's
    ``ParallelGroups``, whose ``tensor_mesh`` is that group), every rank of the job calling it.  The
    stage's tensor-parallel ranks built the same layers, so no weights move first."""
    size = groups.dims.tp
    if block.autotp_size != size:
        raise TensorParallelSizeError(
            f"the pipeline's topology has {size} tensor-parallel ranks per stage, but the config says "
            f"tensor_parallel.autotp_size = {block.autotp_size}: zeroshard splits each stage's linear layers "
            f"itself (DTensor), so set tensor_parallel.autotp_size to {size}")
    plan = plan_linears(stage, block)
    record = split_model(stage, plan, groups, from_rank0=False)
    log_rank(plan.describe(size))
    return record
