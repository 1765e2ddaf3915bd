"""``PipelineModule``: a model given as a list of layers, of which each rank builds its stage's run.

``PipelineModule(layers, num_stages=2)`` splits ``layers`` (``LayerSpec``s, ``TiedLayerSpec``s, built
modules or plain callables) into contiguous runs, one per stage (pipeline/partition.py), and builds only
this rank's run; its ``forward`` applies those layers in order, each taking the previous one's output
(a tensor or a tuple of tensors) as its one argument.  With ``virtual_stages=v`` (zeroshard's own
argument, for the interleaved schedule) the layers are cut into ``num_stages * v`` runs and stage ``r``
holds runs ``r, r + num_stages, ...``, its *chunks*; ``forward(x, chunk=c)`` applies chunk ``c``.  Constructing it joins the process group (as
``initialize()`` would) and builds the groups of every parallel axis (distributed/parallel_dims.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..activations.checkpointing import checkpoint
from ..distributed.parallel_dims import ParallelDims, ParallelGroups, StagesDoNotDivideError
from ..distributed.world import World, init_distributed
from .partition import partition
from .specs import LayerSpec, TiedLayerSpec
from .tied import TiedWeight, TiedWeights


class TiedChunkError(ValueError):
    """With virtual stages, a tied weight whose first use is not in its stage's first chunk."""


class PipeDataParallelTopology:
    """DeepSpeed's topology of ``num_pp`` pipeline stages x ``num_dp`` data-parallel ranks (pipeline outermost)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        self.dims = ParallelDims(num_pp, num_dp)

    def get_dim(self, axis: str) -> int:
        return {"pipe": self.dims.pp, "data": self.dims.dp, "model": self.dims.tp}[axis]

    def world_size(self) -> int:
        return self.dims.world_size


class PipeModelDataParallelTopology(PipeDataParallelTopology):
    """DeepSpeed's topology of ``num_pp`` pipeline stages x ``num_dp`` data-parallel x ``num_mp``
    tensor-parallel ranks, numbered pipeline outermost and tensor innermost (see [Note: the order of the
    axes] in distributed/parallel_dims.py).  zeroshard splits each stage's linear layers over the tensor
    axis itself: the config's ``tensor_parallel.autotp_size`` must equal ``num_mp``."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        self.dims = ParallelDims(num_pp, num_dp, num_mp)


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
        return self._groups.tensor_index

    def get_model_parallel_world_size(self) -> int:
        return self._groups.dims.tp

    def get_model_parallel_group(self) -> Any:
        return self._groups.tensor.world.group if self._groups.tensor is not None else None

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_stage_id(self) -> int:
        return self._groups.stage


class PipelineModule(nn.Module):
    """This stage's layers of a pipelined model (DeepSpeed's ``deepspeed.pipe.PipelineModule``)."""

    def __init__(self, layers: Sequence[Any], num_stages: Optional[int] = None,
                 topology: Optional[PipeDataParallelTopology] = None, loss_fn: Optional[Callable[..., Any]] = None,
                 seed_layers: bool = False, seed_fn: Optional[Callable[[int], Any]] = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable[..., Any] = checkpoint,
                 checkpointable_layers: Optional[list[str]] = None, virtual_stages: int = 1) -> None:
        super().__init__()
        if virtual_stages < 1:
            raise ValueError(f"virtual_stages={virtual_stages}: the chunks per stage are 1 or more")
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
        self.virtual_stages = virtual_stages
        #: ``num_stages * virtual_stages + 1`` boundaries: virtual stage ``k`` holds layers ``bounds[k]:bounds[k+1]``
        self.bounds = partition(self.layer_specs, dims.pp * virtual_stages, partition_method)
        self.groups = ParallelGroups(dims, world)
        self.num_stages = dims.pp
        self.stage_id = self.groups.stage
        if virtual_stages > 1:
            self.groups.gradient_p2p()  # see [Note: a header before every activation] in pipeline/p2p.py
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn or torch.manual_seed, base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self._build_stage(world)

    # ------------------------------------------------------------------ building this stage
    def virtual_stage(self, chunk: int, stage: Optional[int] = None) -> int:
        """The virtual stage of ``chunk`` on ``stage`` (default: this rank's)."""
        return chunk * self.num_stages + (self.stage_id if stage is None else stage)

    def chunk_of_layer(self, index: int) -> tuple[int, int]:
        """``(stage, chunk)`` of global layer ``index``."""
        k = next(k for k in range(len(self.bounds) - 1) if self.bounds[k] <= index < self.bounds[k + 1])
        return k % self.num_stages, k // self.num_stages

    def _build_stage(self, world: World) -> None:
        self.layers = nn.ModuleList()  # this stage's built modules, in order (tied ones under tied_modules)
        self.tied_modules = nn.ModuleDict()
        self._calls: list[list[Callable[[Any], Any]]] = []  # per chunk, what each layer runs
        self._owners: list[list[Any]] = []  # per chunk, each call's module, or a plain callable
        self._tied_specs: dict[str, TiedLayerSpec] = {}
        self._layer_index: list[int] = []  # the global index of each module in self.layers
        self._tied_index: dict[str, int] = {}  # each tied key's first global index on this stage
        for chunk in range(self.virtual_stages):
            k = self.virtual_stage(chunk)
            calls, owners = [], []
            for index in range(self.bounds[k], self.bounds[k + 1]):
                spec = self.layer_specs[index]
                calls.append(self._build_layer(index, spec))
                owners.append(self.tied_modules[spec.key] if isinstance(spec, TiedLayerSpec)
                              else self.layers[-1] if isinstance(spec, LayerSpec) else spec)
            self._calls.append(calls)
            self._owners.append(owners)
        self.to(world.device)
        self._same_over_tensor_group()
        self.tied = TiedWeights(self.groups, self._ties(world.device))
        self.tied.detach_copies()
        self.tied.broadcast_from_owners(lambda m, attr: getattr(m, attr).data)  # every copy starts from the owner's values

    def _same_over_tensor_group(self) -> None:
        """With tensor parallelism, the stage's tensor-parallel ranks start from its first one's weights
        (they split them at ``initialize()``, see [Note: three axes] in pipeline/engine.py)."""
        tensor = self.groups.tensor
        if tensor is None:
            return
        with torch.no_grad():
            for value in [*self.parameters(), *self.buffers()]:
                dist.broadcast(value.data, group_src=0, group=tensor.world.group)

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
                stage, chunk = self.chunk_of_layer(index)
                stages = stages_of.setdefault(spec.key, [])
                if not stages and chunk != 0:
                    raise TiedChunkError(
                        f"tied layer {index} ({spec.key!r}) is the key's first use and sits in chunk {chunk} of "
                        f"stage {stage}: with virtual stages a tied weight's first use must be in a stage's first "
                        f"chunk (layers {self.bounds[stage]}:{self.bounds[stage + 1]}), whose backward is the "
                        f"batch's last there (see [Note: tied weights across stages] in pipeline/tied.py); move "
                        f"it, or use fewer virtual stages")
                if stage not in stages:
                    stages.append(stage)
                attr_of[spec.key] = spec.tied_weight_attr
        ties = []
        for key, stages in stages_of.items():
            # the first use is in a first chunk, so its stage is the lowest that uses the key: the owner
            # (the Note in pipeline/tied.py), and the stages of a key's group are ascending
            stages.sort()
            first = next(s for s in self.layer_specs if isinstance(s, TiedLayerSpec) and s.key == key)
            with torch.device("meta"):
                shape = getattr(first.build(), attr_of[key]).shape
            module = self.tied_modules[key] if key in self.tied_modules else None
            ties.append(TiedWeight(key, tuple(stages), attr_of[key], shape, module))
        return ties

    # ------------------------------------------------------------------ forward
    def forward(self, inputs: Any, chunk: int = 0) -> Any:
        interval = self.activation_checkpoint_interval
        x = inputs
        all_calls, all_owners = self._calls[chunk], self._owners[chunk]
        if interval <= 0 or not torch.is_grad_enabled():
            for call in all_calls:
                x = call(x)
            return x
        for start in range(0, len(all_calls), interval):
            calls = all_calls[start:start + interval]
            if self._checkpointable(all_owners[start:start + interval]):
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
        dims = self.groups.dims
        if dims.tp > 1:
            return PipeModelDataParallelTopology(dims.pp, dims.tp, dims.dp)
        return PipeDataParallelTopology(dims.pp, dims.dp)

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

    def global_module_name(self, name: str) -> str:
        """A module's qualified name on this stage (``layers.<j>[.<rest>]``, ``tied_modules.<key>[.<rest>]``) as
        its name in one ``nn.Sequential`` of every layer (see :meth:`global_name`)."""
        return self.global_name(name + ".")[:-1]

    def layers_replaced(self, before: Sequence[nn.Module]) -> None:
        """After something replaced modules of :attr:`layers` in place (``before``: the list as it was; FP8's
        conversion swaps a layer that is an ``nn.Linear`` for a new module), run the new modules."""
        new_of = {id(old): new for old, new in zip(before, self.layers) if old is not new}
        for calls, owners in zip(self._calls, self._owners):
            for i, owner in enumerate(owners):
                if id(owner) in new_of:
                    owners[i] = calls[i] = new_of[id(owner)]

    def layer_calls(self) -> dict[int, Callable[[Any], Any]]:
        """What each layer this stage holds runs, by global index, every chunk's."""
        out = {}
        for chunk, calls in enumerate(self._calls):
            start = self.bounds[self.virtual_stage(chunk)]
            out.update({start + j: call for j, call in enumerate(calls)})
        return out
