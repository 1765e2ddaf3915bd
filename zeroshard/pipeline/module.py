"""``PipelineModule``: a model given as a list of layers, of which each rank builds its stage's run.

``PipelineModule(layers, num_stages=2)`` splits ``layers`` (``LayerSpec``s, ``TiedLayerSpec``s, built
modules or plain callables) into contiguous runs, one per stage (pipeline/partition.py), and builds only
this rank's run; its ``forward`` applies those layers in order, each taking the previous one's output
(a tensor or a tuple of tensors) as its one argument.  Constructing it joins the process group (as
``initialize()`` would) and builds the groups of every parallel axis (distributed/parallel_dims.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..activations.checkpointing import checkpoint
from ..distributed.parallel_dims import ParallelDims, ParallelGroups, StagesDoNotDivideError
from ..distributed.world import World, init_distributed
from .partition import partition
from .specs import LayerSpec, TiedLayerSpec
from .tied import TiedWeight, TiedWeights


class PipeDataParallelTopology:
    """DeepSpeed's topology of ``num_pp`` pipeline stages x ``num_dp`` data-parallel ranks (pipeline outermost)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        self.dims = ParallelDims(num_pp, num_dp)

    def get_dim(self, axis: str) -> int:
        return {"pipe": self.dims.pp, "data": self.dims.dp}[axis]

    def world_size(self) -> int:
        return self.dims.world_size


class PipelineMPU:
    """The model-parallel unit DeepSpeed's ``module.mpu()`` returns: each axis's rank, size and group."""

    def __init__(self, groups: ParallelGroups) -> None:
        self._groups = groups

    def describes(self, module: "PipelineModule") -> bool:
        """Whether this is ``module``'s own unit (what ``initialize(mpu=module.mpu())`` passes)."""
        return self._groups is module.groups

    def get_pipe_parallel_rank(self) -> int:
        return self._groups.stage

    def get_pipe_parallel_world_size(self) -> int:
        return self._groups.dims.pp

    def get_pipe_parallel_group(self) -> Any:
        return self._groups.pipe.world.group

    def get_data_parallel_rank(self) -> int:
        return self._groups.data

    def get_data_parallel_world_size(self) -> int:
        return self._groups.dims.dp

    def get_data_parallel_group(self) -> Any:
        return self._groups.data_world.group

    def get_model_parallel_rank(self) -> int:
        return 0  # no tensor parallelism

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_stage_id(self) -> int:
        return self._groups.stage


class PipelineModule(nn.Module):
    """This stage's layers of a pipelined model (DeepSpeed's ``deepspeed.pipe.PipelineModule``)."""

    def __init__(self, layers: Sequence[Any], num_stages: Optional[int] = None,
                 topology: Optional[PipeDataParallelTopology] = None, loss_fn: Optional[Callable[..., Any]] = None,
                 seed_layers: bool = False, seed_fn: Optional[Callable[[int], Any]] = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable[..., Any] = checkpoint,
                 checkpointable_layers: Optional[list[str]] = None) -> None:
        super().__init__()
        world = init_distributed()
        if topology is None and num_stages is None:
            raise ValueError("PipelineModule needs num_stages= or topology=")
        dims = topology.dims if topology is not None else ParallelDims.for_world(world.world_size, int(num_stages or 1))
        if num_stages is not None and num_stages != dims.pp:
            raise StagesDoNotDivideError(f"num_stages={num_stages} but the topology has {dims.pp} pipeline stages")
        if dims.world_size != world.world_size:
            raise StagesDoNotDivideError(f"the topology covers {dims.world_size} ranks, the world has "
                                         f"{world.world_size}")
        self.layer_specs = list(layers)
        self.bounds = partition(self.layer_specs, dims.pp, partition_method)
        self.groups = ParallelGroups(dims, world)
        self.num_stages = dims.pp
        self.stage_id = self.groups.stage
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn or torch.manual_seed, base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self._build_stage(world)

    # ------------------------------------------------------------------ building this stage
    def _build_stage(self, world: World) -> None:
        start, stop = self.bounds[self.stage_id], self.bounds[self.stage_id + 1]
        self.layers = nn.ModuleList()  # this stage's built modules, in order (tied ones under tied_modules)
        self.tied_modules = nn.ModuleDict()
        self._calls: list[Callable[[Any], Any]] = []
        self._tied_specs: dict[str, TiedLayerSpec] = {}
        self._layer_index: list[int] = []  # the global index of each module in self.layers
        self._tied_index: dict[str, int] = {}  # each tied key's first global index on this stage
        self._owners: list[Any] = []  # what each call runs: a module, or a plain callable
        for index in range(start, stop):
            spec = self.layer_specs[index]
            self._calls.append(self._build_layer(index, spec))
            self._owners.append(self.tied_modules[spec.key] if isinstance(spec, TiedLayerSpec)
                                else self.layers[-1] if isinstance(spec, LayerSpec) else spec)
        self.to(world.device)
        self.tied = TiedWeights(self.groups, self._ties(world.device))
        self.tied.detach_copies()
        self.tied.broadcast_from_owners(lambda m, attr: getattr(m, attr).data)  # every copy starts from the owner's values

    def _build_layer(self, index: int, spec: Any) -> Callable[[Any], Any]:
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied_modules:
                self._seed(index)
                self.tied_modules[spec.key] = spec.build()
                self._tied_specs[spec.key] = spec
                self._tied_index[spec.key] = index
            module = self.tied_modules[spec.key]
            forward_fn = spec.forward_fn
            return (lambda x: forward_fn(module, x)) if forward_fn is not None else module
        if isinstance(spec, LayerSpec):
            self._seed(index)
            built = spec.build()
            self.layers.append(built)
            self._layer_index.append(index)
            return built
        if isinstance(spec, nn.Module):
            self.layers.append(spec)
            self._layer_index.append(index)
            return spec
        if callable(spec):
            return spec
        raise TypeError(f"layer {index} is {spec!r}: a PipelineModule's layers are LayerSpec, TiedLayerSpec, "
                        f"nn.Module or callables")

    def _seed(self, index: int) -> None:
        if self.seed_layers:
            self.seed_fn(self.base_seed + index)

    def _ties(self, device: torch.device) -> list[TiedWeight]:
        """Every tied key of the whole model (every rank lists all of them, in the same order)."""
        stages_of: dict[str, list[int]] = {}
        attr_of: dict[str, str] = {}
        for index, spec in enumerate(self.layer_specs):
            if isinstance(spec, TiedLayerSpec):
                stage = next(s for s in range(self.num_stages) if self.bounds[s] <= index < self.bounds[s + 1])
                stages = stages_of.setdefault(spec.key, [])
                if stage not in stages:
                    stages.append(stage)
                attr_of[spec.key] = spec.tied_weight_attr
        ties = []
        for key, stages in stages_of.items():
            first = next(s for s in self.layer_specs if isinstance(s, TiedLayerSpec) and s.key == key)
            with torch.device("meta"):
                shape = getattr(first.build(), attr_of[key]).shape
            module = self.tied_modules[key] if key in self.tied_modules else None
            ties.append(TiedWeight(key, tuple(stages), attr_of[key], shape, module))
        return ties

    # ------------------------------------------------------------------ forward
    def forward(self, inputs: Any) -> Any:
        interval = self.activation_checkpoint_interval
        x = inputs
        if interval <= 0 or not torch.is_grad_enabled():
            for call in self._calls:
                x = call(x)
            return x
        for start in range(0, len(self._calls), interval):
            calls = self._calls[start:start + interval]
            if self._checkpointable(self._owners[start:start + interval]):
                x = self._checkpointed(calls, x)
            else:
                for call in calls:
                    x = call(x)
        return x

    def _checkpointable(self, owners: list[Any]) -> bool:
        """Whether a run of layers is recomputed in backward: with ``checkpointable_layers``, when every
        layer's class is named there; else when some layer has parameters (recomputing a run of
        parameter-free functions saves little and costs its compute again), as DeepSpeed decides."""
        if self.checkpointable_layers is not None:
            return all(type(owner).__name__ in self.checkpointable_layers for owner in owners)
        return any(isinstance(owner, nn.Module) and any(True for _ in owner.parameters()) for owner in owners)

    def _checkpointed(self, calls: list[Callable[[Any], Any]], x: Any) -> Any:
        """One checkpointed run of layers: its activations are recomputed in backward."""
        packed = isinstance(x, tuple)

        def run(*args: Any) -> Any:
            y: Any = args if packed else args[0]
            for call in calls:
                y = call(y)
            return y

        return self.activation_checkpoint_func(run, *(x if packed else (x,)))

    # ------------------------------------------------------------------ DeepSpeed's accessors
    def mpu(self) -> PipelineMPU:
        return PipelineMPU(self.groups)

    def topology(self) -> PipeDataParallelTopology:
        return PipeDataParallelTopology(self.groups.dims.pp, self.groups.dims.dp)

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def global_name(self, name: str) -> str:
        """A state-dict key of this stage (``layers.<j>.<rest>``, ``tied_modules.<key>.<rest>``) as the
        key the layer has in one ``nn.Sequential`` of every layer: ``<global index>.<rest>``.  A tied
        module is named by its first layer on this stage, which on its owner is its first layer of all
        (the name a checkpoint keeps the tied weight under, once)."""
        head, _, rest = name.partition(".")
        which, _, tail = rest.partition(".")
        if head == "layers":
            return f"{self._layer_index[int(which)]}.{tail}"
        if head == "tied_modules":
            return f"{self._tied_index[which]}.{tail}"
        raise KeyError(f"{name!r} is not a key of a PipelineModule's layers")

    def stage_layers(self) -> tuple[int, int]:
        """The indices ``[start, stop)`` of the layers this stage holds."""
        return self.bounds[self.stage_id], self.bounds[self.stage_id + 1]
