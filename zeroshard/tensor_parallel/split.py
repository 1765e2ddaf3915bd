"""Split a model's linear layers over a tensor-parallel group with torch's DTensor, keeping plain
parameters for ZeRO.

[Note: DTensor computes, ZeRO holds plain shards]
Each linear of the plan is split by torch's own tensor parallelism (``parallelize_module`` with
``ColwiseParallel`` or ``RowwiseParallel`` over the tensor-parallel mesh): its input and output are
redistributed by the hooks those styles install, and its matrix product runs on DTensors.  The
parameters the module keeps, though, are this rank's shards as ordinary tensors (``to_local()``),
under their own names, so that ZeRO shards, reduces, gathers, offloads and checkpoints them like any
parameter; the layer's forward wraps them back into DTensors (``DTensor.from_local``, whose backward
hands the gradient to the shard) each time it runs, after any stage-3 gather has filled them.  A
column-parallel layer's weight and bias are split by rows, a row-parallel one's weight by columns and
its bias kept whole; every rank of a tensor-parallel group therefore holds a different part of the
split parameters and the same copy of every other one.  Every rank starts from rank 0's full
weights: the model is broadcast once before it is split.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from .plan import TensorPlan


@dataclass(frozen=True)
class SplitModel:
    """What splitting did to a model: its tensor-parallel size, the plan, and the split parameters."""

    size: int
    plan: TensorPlan
    #: the parameters each rank holds a different part of (by identity)
    split: frozenset[int]
    #: the job's tensor x data groups (an mpu: groups.py)
    groups: Any
    #: state-dict name of each split parameter -> the dimension it is split along
    dims: dict[str, int]


#: model -> how it was split (``tp_model_init`` or ``initialize`` split it; never twice)
_SPLIT: "weakref.WeakKeyDictionary[nn.Module, SplitModel]" = weakref.WeakKeyDictionary()


def split_of(model: nn.Module) -> Optional[SplitModel]:
    """How ``model`` was split, if it was."""
    return _SPLIT.get(model)


def _forward_on_dtensors(module: nn.Linear, mesh: DeviceMesh, placements: dict[str, Any], input: Tensor) -> Tensor:
    weight = DTensor.from_local(module.weight, mesh, placements["weight"], run_check=False)
    bias = None if module.bias is None else DTensor.from_local(module.bias, mesh, placements["bias"], run_check=False)
    return F.linear(input, weight, bias)


def _keep_local_shards(module: nn.Linear, mesh: DeviceMesh) -> dict[str, tuple[int, int]]:
    """Replace the module's DTensor parameters with their local shards; returns the split ones' names
    (in the module) with their id and the dimension they are split along."""
    placements: dict[str, Any] = {}
    split: dict[str, tuple[int, int]] = {}
    for name, param in list(module.named_parameters(recurse=False)):
        assert isinstance(param, DTensor)
        placements[name] = param.placements
        local = nn.Parameter(param.to_local().detach().clone(), requires_grad=param.requires_grad)
        del module._parameters[name]
        module.register_parameter(name, local)
        shards = [p for p in param.placements if p.is_shard()]
        if shards:
            split[name] = (id(local), int(getattr(shards[0], "dim")))
    module.forward = functools.partial(_forward_on_dtensors, module, mesh, placements)  # type: ignore[method-assign]
    return split


def split_model(model: nn.Module, plan: TensorPlan, groups: Any, from_rank0: bool = True) -> SplitModel:
    """Split ``model`` in place over ``groups.tensor_mesh`` (the tensor-parallel axis), every rank of the
    job calling it (see [Note: DTensor computes, ZeRO holds plain shards]); ``groups``: a
    ``TensorParallelGroups``, or a pipeline's ``ParallelGroups``.  ``from_rank0``: every rank first takes
    rank 0's weights (a pipeline stage's tensor-parallel ranks already hold their stage's same weights)."""
    mesh: DeviceMesh = groups.tensor_mesh
    if from_rank0 and dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():  # every rank splits rank 0's weights
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
    modules = dict(model.named_modules())
    split: set[int] = set()
    dims: dict[str, int] = {}
    for name, kind in plan.splits:
        module = modules[name]
        parallelize_module(module, mesh, ColwiseParallel() if kind == "column" else RowwiseParallel())
        for param, (ident, dim) in _keep_local_shards(module, mesh).items():
            split.add(ident)
            dims[f"{name}.{param}"] = dim
    record = SplitModel(mesh.size(), plan, frozenset(split), groups, dims)
    _SPLIT[model] = record
    return record
