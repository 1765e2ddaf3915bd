"""The training engine: forward, backward, step, gradient accumulation, clipping and accounting.

The engine only wires parts together and keeps the step counters; what ZeRO does to gradients and
parameters lives in the stage's :class:`~zeroshard.sharding.ShardingStrategy`, what a checkpoint
saves in :class:`~zeroshard.engine.checkpoints.EngineCheckpointer`, and DeepSpeed's accessor names in
:class:`~zeroshard.deepspeed.engine_api.DeepSpeedEngineAPI`: parts the engine owns.

[Note: loss scaling for accumulation]
``engine.backward(loss)`` divides the loss by ``gradient_accumulation_steps`` exactly once, as
DeepSpeed does, so a script passes the plain per-micro-batch mean loss.  Gradients are averaged over
ranks by the reduction, so micro batch 4 x accumulation 1 and micro batch 1 x accumulation 4 give
the same update.
"""

from __future__ import annotations

import dataclasses

import logging
import math
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ..activations import checkpointing as activation_checkpointing
from ..config import ZeroshardConfig
from ..config.schema import ActivationCheckpointingConfig
from ..distributed.collectives import Collectives
from ..distributed.consistency import Call, ConsistencyCheck, EngineUsageError
from ..distributed.parallel_dims import ParallelDims
from ..distributed.topology import Topology, build_shard_groups
from ..distributed.world import World, release_at_exit
from ..sharding.stage3.init_context import adopt_init_params, has_init_params
from ..sharding.stage3.leaf_config import mark_configured_leaves
from ..logging import log_rank
from .metrics import MetricsWriter, PhaseTimers, host_peak_bytes
from ..host.host_allocator import HostMemoryPolicy
from ..host.page_memory import HostPageMemory
from ..optim import build_scheduler, clip_coefficient, from_config, from_user, global_grad_norm
from ..optim.clipping import ExpertsNorm
from ..experts.groups import ExpertGroupRecord, ExpertParallelError, register_expert_groups
from ..experts.checkpoint import ExpertPlacement, with_every_expert
from ..experts.layer import bind_expert_groups, expert_parallel_size
from .memory import memory_breakdown
from ..experts.registry import is_expert_param
from ..optim.param_groups import TrainableParams, collect_trainable
from ..offload import OffloadIOError
from ..optim.no_optimizer import NoOptimizer, no_optimizer_error
from ..optim.nonfinite import NonFiniteGradientError, first_nonfinite_parameter, ranks_with_nonfinite_loss
from ..optim.updaters import build_updater
from ..offload.policy import OffloadPolicies
from ..sharding.buffer_memory import BufferMemory, DeviceMemory
from ..sharding.storage import HOMES, InitialValues, ParameterStorage
from ..sequence.groups import register_sequence_groups
from ..precision import LossScaler, PrecisionPolicy
from .counters import TrainingCounters
from .placement import defer_to_device
from ..checkpoint.background import BackgroundSaves, wait_for_copies
from ..checkpoint.interface import CheckpointParts
from ..sharding import STRATEGIES
from ..deepspeed.engine_api import DeepSpeedEngineAPI
from .checkpoints import Attached, CheckpointSettings, EngineCheckpointer, TrainingParts
from ..errors import InitializeArgumentError
from ..optim.scheduler_rebinding import rebind_scheduler

SchedulerSpec = Union[None, LRScheduler, Callable[[Optimizer], LRScheduler]]

#: model -> the live engine that wraps it (see [Note: an engine's lifetime])
_ENGINE_OF: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[Engine]]" = weakref.WeakKeyDictionary()

#: id(param) -> gathers the full values of a parameter built under zeroshard.Init
FromInit = dict[int, Callable[[], torch.Tensor]]


class ModelAlreadyWrappedError(RuntimeError):
    """``initialize()`` on a model that a live engine still wraps."""


class ModelChangedError(RuntimeError):
    """The wrapped model gained or lost parameters after ``initialize()`` (``get_peft_model``, a new
    head): the engine would neither gather, reduce nor update them."""


class _Counter:
    """An engine attribute that is one of its :class:`TrainingCounters` (DeepSpeed's ``global_steps``, ...)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: Any, owner: Optional[type] = None) -> int:
        return int(getattr(engine.counters, self.name))

    def __set__(self, engine: Any, value: int) -> None:
        setattr(engine.counters, self.name, value)


def _refuse_a_wrapped_model(model: nn.Module) -> None:
    """[Note: an engine's lifetime]
    An engine takes the model over: its parameters become views into zeroshard's storage, and
    hooks on its parameters and (stage 3) modules drive the reductions and gathers.  A model can
    be wrapped by one live engine at a time: ``initialize()`` on a model that is still wrapped
    raises :class:`ModelAlreadyWrappedError`.  ``engine.close()`` hands it back: every hook
    removed, every parameter a plain tensor of its own holding its current full values (at stage
    3 a gather, so every rank calls it), and a new ``initialize()`` on it works.
    """
    previous = _ENGINE_OF.get(model)
    if previous is not None and previous() is not None:
        raise ModelAlreadyWrappedError(
            f"this {type(model).__name__} is already wrapped by a zeroshard engine: call engine.close() on "
            f"that engine first (it hands the model back with its current weights), then initialize() again")


def _adopt_init_parameters(model: nn.Module, config: ZeroshardConfig, world: World
                           ) -> tuple[dict[int, nn.Parameter], FromInit]:
    """A model built under ``zeroshard.Init`` (stage 3 only): its parameters, made ordinary ones, and
    how to gather each one's full values; nothing for any other model."""
    if not has_init_params(model):
        return {}, {}
    if config.stage != 3:
        raise ValueError(f"the model was built under zeroshard.Init, which needs ZeRO stage 3; the "
                         f"config says zero_optimization.stage = {config.stage}")
    return adopt_init_params(model, world.device)


class Engine:
    """Wraps a model for ZeRO data-parallel training; use it like DeepSpeed's engine.

    This class holds what training does.  Checkpoints are :attr:`checkpointer`'s
    (:class:`~zeroshard.engine.checkpoints.EngineCheckpointer`; the engine's checkpoint methods hand
    over to it), and DeepSpeed's accessor names (``fp16_enabled()``, ``zero_optimization_stage()``,
    attribute forwarding to the module, ...) are answered by
    :class:`~zeroshard.deepspeed.engine_api.DeepSpeedEngineAPI` (see [Note: DeepSpeed's names on
    the engine]).
    """

    global_steps = _Counter()
    micro_steps = _Counter()
    global_samples = _Counter()
    skipped_steps = _Counter()

    def __init__(self, model: nn.Module, config: ZeroshardConfig, world: World,
                 model_parameters: Any = None, optimizer: Any = None,
                 lr_scheduler: SchedulerSpec = None, *, axes: Optional[ParallelDims] = None) -> None:
        """Take ``model`` over (see [Note: an engine's lifetime]).  ``axes``: the job's parallel axes,
        ``world`` their ZeRO world (``initialize()`` builds them); by default ``world``'s alone.

        [Note: the order an engine is built in]
        Each step uses what the steps before it built: the policies the config decides; the world
        and the groups the state is sharded over; every rank starting from rank 0's values (the
        storage copies them in); the strategy with its storage, then the parameters it leaves whole;
        the updater over the strategy's buckets, the optimizer over the updater's pieces and the LR
        schedule over the optimizer; the per-step state and metrics; last the parts that read all of
        these (the checkpointer, DeepSpeed's names); then the take-over, after which the collectives'
        byte counts start from zero (set-up is not training traffic).
        """
        _refuse_a_wrapped_model(model)
        # the config's leaf modules, marked before stage 3 plans its units from the marks
        mark_configured_leaves(model, config.zero_optimization.leaf_module)
        replaced, from_init = _adopt_init_parameters(model, config, world)
        self._built_under_init = bool(replaced)
        if config.stage == 3:
            # never the whole model on the device (see [Note: stage 3 moves parameters to the device as
            # their buckets fill] in engine/placement.py)
            from_init.update(defer_to_device(
                (p for p in model.parameters() if id(p) not in from_init), world.device, self._broadcast_start))
        self.module = model.to(world.device)
        self.config = config
        self.counters = TrainingCounters()
        self._decide_policies(config, world.device)
        self._build_groups(world, axes)
        trainable = collect_trainable(model, model_parameters,
                                      optimizer if isinstance(optimizer, Optimizer) else None, replaced)
        self.param_names = trainable.names
        self._sync_initial_state(from_init)
        self._build_storage_and_strategy(trainable, from_init)
        self._keep_frozen_parameters_whole(trainable.frozen, from_init)
        self._build_optimizer(optimizer, trainable.group_options, lr_scheduler)
        self._reset_step_state()
        self._start_metrics()
        self._build_parts()
        self._take_over()

    # ------------------------------------------------------------------ construction steps
    def _decide_policies(self, config: ZeroshardConfig, device: torch.device) -> None:
        """What the config decides, once: host memory, activation checkpointing, precision, loss
        scale, where state lives, and where buffers kept for the run put their memory between uses."""
        self.host_memory = HostMemoryPolicy(config.host_memory_release, config.host_memory_trim).apply()
        # this engine's own settings while its forward runs (see [Note: whose settings a region uses] in
        # activations/checkpointing.py)
        self.checkpointing: Optional[activation_checkpointing.CheckpointingContext] = (
            activation_checkpointing.CheckpointingContext(config.activation_checkpointing)
            if config.activation_checkpointing != ActivationCheckpointingConfig() else None)
        self.precision = PrecisionPolicy.from_config(config)
        self.loss_scaler = LossScaler.from_config(config)
        self.offload = OffloadPolicies.from_config(config.zero_optimization)
        # given to the storage, the stage and its pools, which never ask the device again (see [Note: one
        # buffer memory per engine] in host/buffer_memory.py)
        self.buffer_memory: BufferMemory = (
            HostPageMemory() if config.zero_optimization.host_page_reuse and HostPageMemory.serves(device)
            else DeviceMemory())

    def _build_groups(self, world: World, axes: Optional[ParallelDims] = None) -> None:
        """The world (which ranks share a node), its collectives, the consistency check, the group of
        asynchronous saves and the groups the training state is sharded over, from the job's axes
        (hybrid sharding and experts: see distributed/topology.py)."""
        self.topology = Topology.discover(world)
        self.world = dataclasses.replace(world, spans_nodes=self.topology.spans_nodes(range(world.world_size)))
        self.comm = Collectives(self.world)
        self._agree = ConsistencyCheck(self.comm)
        self.saves = BackgroundSaves(self.world)  # asynchronous checkpoint saves
        zero = self.config.zero_optimization
        #: every parallel axis of the job (distributed/parallel_dims.py)
        self.parallel_dims = axes if axes is not None else ParallelDims.for_job(
            world.world_size, mics_shard_size=zero.mics_shard_size, hpz_partition_size=zero.zero_hpz_partition_size,
            ep=expert_parallel_size(self.module), sp=self.config.sequence_parallel_size)
        self.expert_parallel_size = self._expert_parallel_size(world)
        self.shard_groups = build_shard_groups(self.comm, self.topology, self.parallel_dims,
                                               STRATEGIES[self.config.stage].traits.gathers_in_passes)
        bind_expert_groups(self.module, self.shard_groups.expert_parallel, self.comm)
        exchange, experts_data = self.shard_groups.expert_parallel, self.shard_groups.expert_data
        #: DeepSpeed's deepspeed.utils.groups answers with these while the engine lives
        self._expert_groups = register_expert_groups(self.expert_parallel_size, ExpertGroupRecord(
            exchange, experts_data, self.comm)) if exchange is not None and experts_data is not None else None
        #: DistributedAttention and deepspeed.utils.groups use this sequence group while the engine lives
        self._sequence_groups = register_sequence_groups(self.shard_groups.sequence, self.comm)

    def _expert_parallel_size(self, world: World) -> int:
        """The model's MoE layers' ``ep_size``, the job's expert axis (see [Note: experts sharded over
        the ranks that hold them] in experts/groups.py)."""
        ep_size = expert_parallel_size(self.module)
        if ep_size != self.parallel_dims.ep:
            raise ExpertParallelError(f"the model's MoE layers have ep_size={ep_size}, but the job's axes were "
                                      f"built with an expert axis of {self.parallel_dims.ep}")
        zero = self.config.zero_optimization
        if ep_size > 1 and (zero.mics_shard_size > 0 or zero.zero_hpz_partition_size > 1 or world.parts):
            raise ExpertParallelError(
                f"MoE(ep_size={ep_size}) with MiCS / hpZ groups, pipeline or tensor parallelism is not "
                f"supported yet: expert parallelism runs over a plain data-parallel world")
        if ep_size > 1 and self._built_under_init:
            raise ExpertParallelError(
                f"MoE(ep_size={ep_size}) in a model built under zeroshard.Init is not supported yet: Init shards "
                f"every parameter over the whole world, experts included; build the model outside Init (stage 3 "
                f"moves it to the device bucket by bucket)")
        return ep_size

    def _sync_initial_state(self, from_init: FromInit) -> None:
        """Start every rank from rank 0's parameters and buffers, as DistributedDataParallel does."""
        with torch.no_grad():
            for p in self.module.parameters():
                # built under Init (identical on every rank), or moved at stage 3 as its bucket fills,
                # which broadcasts it then
                if id(p) not in from_init:
                    self._broadcast_start(p, p.data)
            for b in self.module.buffers():
                self.comm.broadcast(b.data, 0, "init_buffers")

    def _broadcast_start(self, param: nn.Parameter, values: torch.Tensor) -> None:
        """Rank 0's start values; an expert's from the first rank holding the same experts."""
        experts = self.shard_groups.expert_data
        if experts is not None and is_expert_param(param):
            experts.broadcast(values, 0, "init_experts")
        else:
            self.comm.broadcast(values, 0, "init_params")

    def _build_storage_and_strategy(self, trainable: TrainableParams, from_init: FromInit) -> None:
        """The stage's strategy, which lays the parameters out in its storage and takes them over."""
        name_of = {id(p): n for n, p in self.module.named_parameters()}
        experts = [i for i, p in enumerate(trainable.params) if is_expert_param(p)] \
            if self.shard_groups.expert_data is not None else []
        self.strategy = STRATEGIES[self.config.stage].build(
            self.module, trainable.params, trainable.names, trainable.group_of, self.shard_groups,
            self.config.zero_optimization, self.precision, self.offload, InitialValues(from_init),
            [(name_of[id(p)], p) for p in trainable.frozen], buffer_memory=self.buffer_memory, experts=experts)
        #: stage 0 with expert parallelism: the experts' part of the norm is summed over their group
        self._experts_norm = ExpertsNorm(frozenset(b.index for b in self.strategy.layout.buckets if b.experts),
                                         self.shard_groups.expert_parallel) \
            if self.shard_groups.expert_parallel is not None else None
        self.storage = self.strategy.storage
        self.storage.set_copy_gate(self.saves)  # an asynchronous save's copy

    def _keep_frozen_parameters_whole(self, frozen: list[nn.Parameter], from_init: FromInit) -> None:
        """Frozen parameters the storage does not hold stay whole in their modules (all of them below
        stage 3; see [Note: frozen parameters at stage 3] in sharding/stage3/units.py), with full
        values, in the compute dtype like the rest of the model."""
        self.frozen_params = [p for p in frozen if HOMES.home_of(p) is None]
        with torch.no_grad():
            for p in self.frozen_params:
                if id(p) in from_init:  # built under Init, or moved at stage 3: its values now, in order
                    p.data = from_init[id(p)]().clone()
        self._convert_rest_of_model()

    def _convert_rest_of_model(self) -> None:
        """Mixed precision: frozen parameters and floating-point buffers compute in 16 bits too, as
        DeepSpeed's ``module.half()`` / ``bfloat16()`` makes them (the trainable ones already do)."""
        if not self.precision.mixed:
            return
        dtype = self.precision.compute
        with torch.no_grad():
            for p in self.frozen_params:
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
            for module in self.module.modules():
                for name, b in module._buffers.items():
                    if b is not None and b.is_floating_point():
                        module._buffers[name] = b.to(dtype)

    def _build_optimizer(self, optimizer: Any, options: list[dict[str, Any]], lr_scheduler: SchedulerSpec) -> None:
        """What the optimizer updates and where it lives (see [Note: pieces] in optim/updater.py), the
        optimizer over it, and the LR schedule."""
        self.updater = build_updater(self.strategy, self.offload)
        self.strategy.add_reduced_listener(self.updater.grad_reduced)
        self._optimizer_given = isinstance(optimizer, Optimizer)
        self.optimizer = self._optimizer_over_pieces(optimizer, options)
        self.updater.attach(self.optimizer)
        setattr(self.optimizer, "overflow", False)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)

    def _optimizer_groups(self, options: list[dict[str, Any]]) -> list[dict[str, Any]]:
        groups = [{**opts, "params": []} for opts in options]
        for bucket in self.strategy.layout.buckets:
            groups[bucket.group_index]["params"].extend(self.updater.params_of(bucket))
        return groups

    def _optimizer_over_pieces(self, optimizer: Any, options: list[dict[str, Any]]) -> Optimizer:
        groups = self._optimizer_groups(options)
        if isinstance(optimizer, Optimizer):
            # Keep the user's object (a scheduler may already hold it): swap its tensors for our chunks.
            if any(len(s) for s in optimizer.state.values()):
                raise ValueError("initialize(optimizer=...) got an optimizer that has already stepped; "
                                 "pass a fresh one so that zeroshard can rebuild it over the shards")
            for target, group in zip(optimizer.param_groups, groups):
                target["params"] = group["params"]
            optimizer.state.clear()
            return optimizer
        if optimizer is not None:
            return from_user(optimizer, groups)
        if self.config.optimizer is None:  # see [Note: an engine without an optimizer] in optim/no_optimizer.py
            if self.strategy.stage in (1, 2):
                raise InitializeArgumentError(
                    f"ZeRO stage {self.strategy.stage} shards the optimizer's state, and initialize() got no "
                    f"optimizer: add an 'optimizer' block to the config or pass optimizer=, or use stage 0 or 3 "
                    f"for an engine that runs forward passes only")
            return NoOptimizer(groups)
        return from_config(self.config.optimizer.type, self.config.optimizer.params, groups,
                           on_host=self.offload.optimizer_on_host)

    def _build_scheduler(self, spec: SchedulerSpec) -> Optional[LRScheduler]:
        if isinstance(self.optimizer, NoOptimizer) and (spec is not None or self.config.scheduler is not None):
            raise InitializeArgumentError("initialize() got a learning-rate schedule but no optimizer: add an "
                                          "'optimizer' block to the config or pass optimizer=")
        if isinstance(spec, LRScheduler):
            if spec.optimizer is self.optimizer:
                return spec
            if self._optimizer_given:
                raise InitializeArgumentError(
                    "initialize(lr_scheduler=...) got a scheduler built on another optimizer than the one passed "
                    "as optimizer=; build it on that optimizer, or pass a callable lr_scheduler")
            # built before the engine's optimizer existed (see [Note: a scheduler built before
            # initialize()] in optim/scheduler_rebinding.py)
            return rebind_scheduler(spec, self.optimizer, self.module.parameters())
        if spec is not None:
            return spec(self.optimizer)
        if self.config.scheduler is not None:
            return build_scheduler(self.config.scheduler.type, self.config.scheduler.params, self.optimizer)
        return None

    def _whole_model(self, experts: Optional[ExpertPlacement]
                     ) -> Optional[Callable[[dict[str, torch.Tensor], bool], dict[str, torch.Tensor]]]:
        """How this rank's full state dict becomes the whole model's, where it holds part of it (see
        ``TrainingParts.whole_model``): every rank's experts gathered under their global names."""
        if experts is None:
            return None
        return lambda state, keep: with_every_expert(state, experts, keep)

    def _tensor_slice(self) -> Optional[tuple[int, int, dict[str, int]]]:
        """Where zeroshard split the model over a tensor-parallel group (``TrainingParts.tensor_slice``)."""
        return None

    def _reset_step_state(self) -> None:
        """The state of the micro step in progress: a fresh optimizer step at a boundary."""
        # API misuse checks: step() needs a backward() before it; one backward() per boundary
        self._backwards_since_step = 0
        self._boundary_backward_done = False
        # a micro step since the last step had a NaN/inf loss: a device flag, read on a skipped step only
        self._nonfinite_loss: Optional[torch.Tensor] = None
        self._consecutive_skips = 0  # non-finite steps in a row (see optim/nonfinite.py)
        # set_gradient_accumulation_boundary(): a caller (Accelerate) that decides the boundary itself
        self._boundary_override: Optional[bool] = None
        self._grad_norm: Optional[float] = None
        #: the last micro step's loss, on the device until a log or metric reads it (see [Note: one host
        #: read per optimizer step])
        self._last_loss: Optional[torch.Tensor] = None

    def _start_metrics(self) -> None:
        """The first metrics window, the phase timers and the JSONL / TensorBoard / CSV writer (rank 0)."""
        self._window_start = time.perf_counter()
        self._window_steps = 0
        self._window_comm = (0, 0.0)
        self._tokens = 0
        self._timers = PhaseTimers()
        self.last_metrics: Optional[dict[str, Any]] = None
        tb, csv, main = self.config.tensorboard, self.config.csv_monitor, self.world.is_main
        self._writer = MetricsWriter(
            self.config.metrics_path if main else None,
            f"{tb.output_path}/{tb.job_name}" if tb.enabled and main else None,
            str(Path(csv.output_path or ".") / csv.job_name) if csv.enabled and main else None)

    def _build_parts(self) -> None:
        """The parts built over the engine: the checkpointer and DeepSpeed's names.

        [Note: parts hold the engine weakly]
        A part that needs something of the engine at call time reads it through a weak proxy of the
        engine, never through the engine itself, so that no part keeps its engine alive: an engine
        nobody references goes by reference counting, without waiting for the cycle collector, and
        its storage, swap files and hooks go with it.
        """
        self.data_loader: Any = None  # set by initialize(training_data=...); checkpoints record its position
        engine = weakref.proxy(self)
        groups = self.shard_groups
        experts = ExpertPlacement.of(self.module, groups.expert_parallel, groups.expert_data) \
            if groups.expert_parallel is not None and groups.expert_data is not None else None
        parts = TrainingParts(self.module, self.param_names, self.strategy, self.updater, self.optimizer,
                              self.loss_scaler, self.counters, experts, self._whole_model(experts),
                              self._tensor_slice())
        self.checkpointer = EngineCheckpointer(
            parts, self.world, self.comm, self._agree, self.saves,
            CheckpointSettings.from_config(self.config, self.precision, self.offload),
            attached=lambda: Attached(engine.lr_scheduler, engine.data_loader),
            resume_at_boundary=lambda: engine._resume_at_boundary())
        self._deepspeed = DeepSpeedEngineAPI(engine)

    def _take_over(self) -> None:
        """Register the engine as the model's (see [Note: an engine's lifetime]) and as one to release
        at exit; the traffic of set-up is not training traffic."""
        self.comm.reset_counters()
        #: the parameters' names as the engine took them over (see ``_check_unchanged``)
        self._parameter_names = [name for name, _ in self.module.named_parameters()]
        self._closed = False
        _ENGINE_OF[self.module] = weakref.ref(self)
        release_at_exit(self._release_at_exit)

    def __getattr__(self, name: str) -> Any:
        """[Note: DeepSpeed's names on the engine]
        DeepSpeed's accessors (``engine.fp16_enabled()``, ``engine.local_rank``, ...) and, as in
        DeepSpeed, any attribute of the wrapped module (``engine.generate(...)``) are reached on the
        engine.  The engine answers every name it does not define itself with its
        :class:`DeepSpeedEngineAPI` part (``answer``), which has DeepSpeed's accessor of that name or
        hands the lookup on to the module: one fallback, where naming each of some thirty accessors
        again here would give the engine DeepSpeed's vocabulary (see [Note: one thin layer for
        DeepSpeed's names] in deepspeed/engine_api.py).  What the engine defines comes first, so
        none of its own names is ever a module's.
        """
        deepspeed = self.__dict__.get("_deepspeed")
        if deepspeed is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")
        return deepspeed.answer(name)

    # ------------------------------------------------------------------ the training step
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        self._check_unchanged()
        if self.strategy.traits.forward_communicates:
            self._agree.agree(Call.FORWARD, self.micro_steps, self.global_steps)
        self.strategy.before_forward()
        tokens = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if tokens is not None and not tokens.is_floating_point() and torch.is_grad_enabled():
            self._tokens += tokens.numel()  # token ids: counted for tokens/s and TFLOP/s
        if self.precision.mixed:  # floating-point inputs meet the 16-bit weights in their dtype
            args = tuple(self._to_compute(a) for a in args)
            kwargs = {k: self._to_compute(v) for k, v in kwargs.items()}
        if self.checkpointing is None:
            output = self.module(*args, **kwargs)
        else:
            with activation_checkpointing.using(self.checkpointing):
                output = self.module(*args, **kwargs)
        self._timers.add("forward", started)
        return output

    def _check_unchanged(self) -> None:
        """Refuse a model whose parameters changed since ``initialize()``: a silent half-trained model
        otherwise (the new parameters get gradients nobody reduces or applies)."""
        names = [name for name, _ in self.module.named_parameters()]
        if names != self._parameter_names:
            added = sorted(set(names) - set(self._parameter_names))[:5]
            removed = sorted(set(self._parameter_names) - set(names))[:5]
            raise ModelChangedError(
                f"the model's parameters changed after initialize() (added {added}, removed {removed}): "
                f"change the model (get_peft_model, resize_token_embeddings, a new head) before initialize(), "
                f"or engine.close() and initialize() again")

    def _to_compute(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.precision.compute)
        return value

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro step is the last one before an optimizer step (or what
        :meth:`set_gradient_accumulation_boundary` said, while it is set)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: Optional[bool]) -> None:
        """Let the caller decide whether the coming micro step ends an accumulation cycle.

        Accelerate counts micro steps itself and calls ``step()`` only at its own boundaries, so its
        word overrides zeroshard's count (``None`` gives the decision back to the count), as in
        DeepSpeed.
        """
        self._boundary_override = is_boundary

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True, retain_graph: bool = False) -> torch.Tensor:
        """Backpropagate ``loss / gradient_accumulation_steps`` (times the fp16 loss scale) and reduce
        gradients as the stage says.  ``scale_wrt_gas=False``: the caller already divided the loss."""
        if isinstance(self.optimizer, NoOptimizer):  # every rank, before any collective
            raise no_optimizer_error("backward()")
        started = time.perf_counter()
        # first: ranks may disagree; verified before the backward's first collective (see [Note: the
        # backward's check runs behind its compute] in distributed/consistency.py)
        self._agree.agree(Call.BACKWARD, self.micro_steps, self.global_steps, behind_compute=True)
        at_boundary = self.is_gradient_accumulation_boundary()
        if at_boundary and self._boundary_backward_done:
            self._agree.verify()  # ranks that diverged: every rank raises that instead
            raise EngineUsageError("backward() called twice at a gradient accumulation boundary without step() "
                                   "in between: call engine.step() after each backward()")
        self._boundary_backward_done = at_boundary
        self._backwards_since_step += 1
        self.strategy.wait_for_buckets(None)  # a parameter no forward module waited for is current too
        divisor = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        if self.loss_scaler.scale != 1.0:  # fp16: in fp32, so that the scaled loss cannot overflow
            scaled = loss.float() * (self.loss_scaler.scale / divisor)
        else:
            scaled = loss / divisor
        self.strategy.sync_gradients = self.is_gradient_accumulation_boundary()
        self.strategy.expect_gradients(scaled)
        scaled.backward(retain_graph=retain_graph)
        self.strategy.finish_backward()
        self._last_loss = loss.detach()
        nonfinite = torch.isfinite(self._last_loss).logical_not_().any()
        seen = self._nonfinite_loss
        self._nonfinite_loss = nonfinite if seen is None else seen.logical_or_(nonfinite)
        self._timers.add("backward", started)
        return scaled

    def step(self) -> None:
        """Update the parameters at an accumulation boundary; otherwise only count the micro step."""
        if isinstance(self.optimizer, NoOptimizer):
            raise no_optimizer_error("step()")
        started = time.perf_counter()
        boundary = self.is_gradient_accumulation_boundary()
        if boundary or not self._backwards_since_step:  # first: another rank may be in its backward
            self._agree.agree(Call.STEP, self.micro_steps, self.global_steps)
        if not self._backwards_since_step:
            raise EngineUsageError("step() called without a backward() since the last step(): each micro "
                                   "step is engine(batch) -> engine.backward(loss) -> engine.step()")
        self._backwards_since_step = 0
        self._boundary_backward_done = False
        if boundary:
            self._optimizer_step()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self.saves.stepped()  # an asynchronous save spread over steps writes its next share
            self.host_memory.after_step()  # the step's activations and gradients are freed by now
        self.micro_steps += 1
        self._timers.add("step", started)
        if boundary:
            self.checkpointer.save_periodically()
        if self.micro_steps % self.gradient_accumulation_steps() == 0 and \
                self.global_steps % self.config.steps_per_print == 0:
            self._log_progress()

    def _optimizer_step(self) -> None:
        """[Note: one host read per optimizer step]
        On a GPU every read of a device value on the host (``float()``, ``.item()``, ``bool()``, a
        blocking copy to the CPU) waits until the GPU has run everything queued before it, and the GPU
        then idles while the host queues the next work.  Between two optimizer steps the engine reads
        one value: the global gradient norm, once it is summed over ranks, because whether the step is
        taken at all (a non-finite norm skips it on every rank, see [Note: non-finite gradients] in
        optim/nonfinite.py) decides what the host does next, and torch's optimizers (but the fused
        ones) cannot skip a step on a device flag.  The clipping coefficient and the norm that
        ``get_global_grad_norm()`` returns come with that read.  Everything else stays on the device:
        each bucket's norm (see [Note: the norm stays on the device] in optim/clipping.py), the loss of
        every micro step (read when a log line, ``metrics_record()`` or the user asks for it) and the
        flag of a non-finite loss (read on a skipped step only).  tests/distributed/test_parity.py
        counts the host reads of steady-state steps at every stage.
        """
        # an asynchronous save copies what this step changes (see [Note: asynchronous saves] in
        # checkpoint/background.py)
        wait_for_copies()
        self.storage.take_back_chunks()  # the optimizer steps the chunks in place
        self._raise_swap_failures()  # a parameter shard that could not be read: stop before updating
        grads = [self.strategy.owned_grad(b) for b in self.strategy.layout.buckets]  # on the device
        shard_comm = self.strategy.comm  # the shard group: replicas (MiCS) hold the same averaged shard
        sharded = self.strategy.traits.grads_are_sharded and shard_comm.world.is_distributed
        # the step's one read of a device value on the host (see [Note: one host read per optimizer step])
        scaled_norm = float(self._model_grad_norm(grads, shard_comm if sharded else None))
        scale = self.loss_scaler.scale
        self._grad_norm = scaled_norm / scale
        overflow = not math.isfinite(scaled_norm)  # the norm is summed over ranks: every rank sees it
        setattr(self.optimizer, "overflow", overflow)  # DeepSpeed's flag: Accelerate reads it to see a skip
        if overflow:
            self._skip_step(grads)  # see [Note: non-finite gradients] in optim/nonfinite.py
            return
        self._consecutive_skips = 0
        self._nonfinite_loss = None
        self.loss_scaler.update(overflow=False, step=self.global_steps + 1)
        clip = clip_coefficient(self._grad_norm, self.config.gradient_clipping)
        # fp32: the gradient buffers, clipped in place; masters: fp32 copies (on the host under
        # offload), unscaled and clipped by the factor
        prepared, factor = self.updater.prepare_step(grads, clip, scale)
        step_grads: list[Optional[torch.Tensor]] = list(prepared)
        del grads, prepared  # each bucket's gradients go once it is stepped (see [Note: gradients live
        self._step_and_refresh(step_grads, factor)  # from backward to the step] in sharding/strategy.py)
        self.strategy.zero_grad()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _model_grad_norm(self, grads: list[torch.Tensor], comm: Optional[Collectives]) -> torch.Tensor:
        """The norm of the whole model's gradients (``comm``: summed over the shards); a pipeline stage's
        engine adds the other stages' (pipeline/stage_engine.py)."""
        return global_grad_norm(grads, comm, self.world.device, self._experts_norm)

    def _skip_step(self, grads: list[torch.Tensor]) -> None:
        """A non-finite gradient norm: parameters, optimizer state and LR schedule stay as they are."""
        step = self.global_steps + 1
        if self.loss_scaler.checks_overflow:  # fp16: an overflow, handled by the loss scale
            scale = self.loss_scaler.scale
            self.strategy.zero_grad()
            self.loss_scaler.update(overflow=True, step=step)  # raises at the minimum scale
            self.skipped_steps += 1
            log_rank(f"step {step}: gradient overflow at loss scale {scale:g}, step skipped "
                     f"(loss scale now {self.loss_scaler.scale:g}, {self.skipped_steps} skipped so far)")
            return
        self.skipped_steps += 1
        self._consecutive_skips += 1
        ranks = ranks_with_nonfinite_loss(self.comm, self._nonfinite_loss is not None and bool(self._nonfinite_loss))
        self._nonfinite_loss = None
        source = f"non-finite loss on rank(s) {ranks}" if ranks else "every rank's loss was finite: it arose in backward"
        if self._consecutive_skips >= self.config.max_consecutive_skips:
            name = first_nonfinite_parameter(self.strategy.comm, self.strategy.ranks, self.strategy.layout.buckets,
                                             grads, self.param_names)
            raise NonFiniteGradientError(
                f"{self._consecutive_skips} optimizer steps in a row (up to step {step}) had non-finite "
                f"gradients ({source}; first parameter with a non-finite gradient: {name!r}); training "
                f"stops instead of going on without updates (config key max_consecutive_skips)")
        self.strategy.zero_grad()
        log_rank(f"step {step}: non-finite gradient norm ({source}), step skipped: parameters, optimizer "
                 f"state and LR schedule unchanged ({self._consecutive_skips} in a row, {self.skipped_steps} "
                 f"skipped so far)", level=logging.WARNING)

    def _step_and_refresh(self, grads: list[Optional[torch.Tensor]], factor: float) -> None:
        """Update the owned chunks bucket by bucket, gathering each one while the next is updated.

        [Note: stepping bucket by bucket]
        A torch optimizer skips parameters whose ``.grad`` is None, so calling ``step()`` once per
        bucket, with only that bucket's chunk holding a gradient, updates each chunk exactly once,
        with the user's own optimizer and its per-tensor state untouched.  What it buys: the
        all-gather of bucket k (stages 1-2) runs while bucket k+1 is being updated, instead of the
        whole gather waiting behind the whole update.  Buckets go in the order the next forward will
        want them (the reverse of the bucket order).

        With fp32 masters (mixed precision, offload) the update reads the bucket's gradient in fp32,
        multiplied by ``factor`` (1 / loss scale, times the clipping coefficient), one piece at a time;
        after each piece the masters are rounded into the parameters (``publish_piece``).
        """
        order = list(reversed(self.strategy.layout.buckets))
        self.updater.begin_step(order)
        for bucket in order:
            grad = grads[bucket.index]
            assert grad is not None
            grads[bucket.index] = None
            self.updater.step_bucket(bucket, grad, factor)
            del grad
            self.strategy.release_grad(bucket)  # its memory goes now, while the gathers run
            self.strategy.refresh_bucket(bucket)
        self.updater.end_step()
        self.strategy.end_refresh()  # stages 1-2: may run on into the next forward
        self._raise_swap_failures()

    def _raise_swap_failures(self) -> None:
        """NVMe offload: a swap read or write that failed on any rank stops every rank, together.

        A failing rank keeps issuing the step's collectives (its update stops, see [Note: NVMe
        sub-groups] in optim/nvme_updater.py); here one scalar all-reduce tells every rank, and each raises
        an OffloadIOError: the failing ones with the file and the reason, the others naming them.
        """
        if not self.offload.uses_nvme:
            return
        failures = [f for f in (self.updater.take_failure(), self.storage.take_failure()) if f is not None]
        failed = self.comm.all_reduce_scalar(float(bool(failures)), "offload_io_check") \
            if self.world.is_distributed else float(bool(failures))
        if failures:
            raise failures[0]
        if failed:
            raise OffloadIOError(f"swap I/O failed on {int(failed)} other rank(s) (their error names the file); "
                                 f"this rank stops with them")

    def _release_at_exit(self) -> None:
        """See [Note: a clean exit] in distributed/world.py: no collective here (a rank may be gone)."""
        self.saves.release()
        self._release(hand_back=False)
        self._agree.release()
        self.shard_groups.release()

    def close(self) -> None:
        """Hand the model back and release what the engine holds (see [Note: an engine's lifetime]).

        Every rank calls it (stage 3 gathers the weights one last time).  Swap files are removed
        now (NVMe offload; otherwise they go when the process exits), and the engine's own process
        group for its consistency check is destroyed.  Idempotent.
        """
        if not self._closed:
            self.saves.close()
            self._release(hand_back=True)
            try:
                self._agree.close()  # raises if the last check in flight finds the ranks diverged
            finally:
                self.shard_groups.close()

    def _release(self, hand_back: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self.strategy.finish_refresh()
        self.strategy.remove_hooks()
        if hand_back:
            self.storage.detach_parameters()
        self.updater.close()
        self.storage.close()
        self.buffer_memory.drop_all()  # parked pages go back to the system
        self._sequence_groups = None  # a model handed back attends over whole sequences
        _ENGINE_OF.pop(self.module, None)

    def zero_grad(self) -> None:
        """Drop gradients accumulated so far. ``step()`` already does this after each update."""
        self.strategy.zero_grad()
        for p in self.strategy.params:
            p.grad = None

    # ------------------------------------------------------------------ checkpoints and full weights
    def save_checkpoint(self, save_dir: Union[str, Path], tag: Any = None, client_state: Any = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: Optional[bool] = None) -> Path:
        """Write a sharded checkpoint under ``save_dir/tag`` (see zeroshard/checkpoint/format.py); returns
        that directory.

        ``tag`` may be of any type (DeepSpeed scripts pass step numbers): it names a directory by
        ``str(tag)``.  ``exclude_frozen_parameters`` leaves frozen parameters out (a LoRA job's base
        model, which the job loads from its pretrained weights anyway); a load then keeps the model's
        current frozen values.  ``async_save`` (default: ``checkpoint.writer.decoupled``): return at once;
        the state is copied (the next optimizer step waits for that), written and published in the
        background (see [Note: asynchronous saves] in checkpoint/background.py).
        """
        return self.checkpointer.save(save_dir, tag, client_state, save_latest, exclude_frozen_parameters, async_save)

    def wait_for_checkpoint(self) -> Optional[Path]:
        """Block until the asynchronous save in flight is published; returns its directory (None when
        none was in flight).  Raises its error, on every rank, if it failed."""
        return self.saves.wait()

    def load_checkpoint(self, load_dir: Union[str, Path], tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, load_rng_state: Optional[bool] = None,
                        ) -> tuple[Optional[Path], Any]:
        """Load a checkpoint saved at any world size and stage; returns ``(path, client_state)``.

        [Note: who owns the random number generators on resume]
        ``load_rng_state=None`` (the default) restores torch's RNG states from the checkpoint only
        when this engine owns the data pipeline (``initialize(training_data=...)``): then resume is
        bitwise, data order included.  A script with its own loader keeps its own seeding, as under
        DeepSpeed, whose ``load_checkpoint`` never touches the global generators: a DeepSpeed script
        therefore resumes with the data order it had there.  ``True``/``False`` decide explicitly.

        The engine resumes at a step boundary, with its own accumulation (see :meth:`_resume_at_boundary`).
        """
        return self.checkpointer.load(load_dir, tag, load_module_strict, load_optimizer_states,
                                      load_lr_scheduler_states, load_module_only, load_rng_state)

    def _resume_at_boundary(self) -> None:
        """After a load the next optimizer step takes this engine's ``gradient_accumulation_steps``
        micro batches, whatever the checkpoint was saved with (see ``TrainingCounters.resume_at_boundary``).

        What a micro step before the load left behind belongs to the parameters the load replaced:
        its gradients are dropped, and the checks on ``backward()``/``step()`` start a fresh step.
        """
        self.counters.resume_at_boundary(self.gradient_accumulation_steps())
        self.zero_grad()
        self._backwards_since_step = 0
        self._boundary_backward_done = False
        self._nonfinite_loss = None

    def checkpoint_parts(self) -> CheckpointParts:
        """The engine's stateful parts, as a checkpoint saves and restores them (checkpoint/interface.py)."""
        return self.checkpointer.checkpoint_parts()

    def save_16bit_model(self, save_dir: Union[str, Path], save_filename: str = "model.safetensors",
                         dtype: Optional[torch.dtype] = None, exclude_frozen_parameters: bool = False,
                         ) -> Optional[Path]:
        """Rank 0 writes the full weights in 16 bits to ``save_dir/save_filename``; every rank calls it.

        The file is what its name says: a torch pickle for ``.bin``/``.pt``/``.pth`` (DeepSpeed's
        ``pytorch_model.bin``), safetensors otherwise.  ``dtype``: default the training dtype under
        mixed precision, else bf16.  At stage 3 the weights are gathered (one bucket at a time) only
        when ``stage3_gather_16bit_weights_on_model_save`` is true; otherwise nothing is written and a
        warning says so, as DeepSpeed does.  ``exclude_frozen_parameters`` leaves frozen ones out.
        """
        return self.checkpointer.save_16bit_model(save_dir, save_filename, dtype, exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether ``save_16bit_model`` gathers full weights (always below stage 3; the config's
        ``stage3_gather_16bit_weights_on_model_save`` at stage 3)."""
        return self.checkpointer.settings.gathers_16bit_weights

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The model's ordinary state dict with full values, as CPU tensors.

        Gathers one bucket at a time (peak: one bucket beyond the shards).  Every rank must call it;
        with ``rank0_only`` the other ranks get an empty dict.  Tied weights appear under each of
        their names, as ``nn.Module.state_dict`` gives them, so ``load_state_dict(strict=True)`` works.
        """
        return self.checkpointer.full_state_dict(rank0_only)

    def _log_progress(self) -> None:
        """Every ``steps_per_print`` steps: a log line on rank 0, and the JSONL / TensorBoard record."""
        record = self.metrics_record()
        self.last_metrics = record
        if self.world.is_main:
            self._writer.write(record)
        line = (f"step {record['step']}: loss {record['loss']:.4f} lr {record['lr']:.3e} "
                f"grad_norm {record['grad_norm']:.4f} samples/s {record['samples_per_s']:.1f} "
                f"tokens/s {record['tokens_per_s']:.0f} TFLOP/s {record['tflops']:.3f} "
                f"comm {record['comm_mib']:.1f} MiB/{record['comm_s']:.2f}s "
                f"host peak {record['host_peak_mib']:.0f} MiB")
        if self.config.wall_clock_breakdown:
            line += " | " + " ".join(f"{k} {record[k + '_s']:.3f}s" for k in ("forward", "backward", "step"))
        log_rank(line)

    def metrics_record(self) -> dict[str, Any]:
        """The metrics since the previous record (resets the window)."""
        now = time.perf_counter()
        elapsed = max(now - self._window_start, 1e-9)
        steps = self.global_steps - self._window_steps
        tokens_per_s = self._tokens * self.world.world_size / elapsed
        comm_bytes = self.comm.total_bytes_sent()
        comm_seconds = sum(c.seconds for c in self.comm.counters.values())
        record: dict[str, Any] = {
            "step": self.global_steps, "loss": None if self._last_loss is None else float(self._last_loss),
            "lr": self.get_lr()[0],
            "grad_norm": self._grad_norm, "samples_per_s": steps * self.train_batch_size() / elapsed,
            "tokens_per_s": tokens_per_s, "tflops": 6 * self.strategy.layout.numel * tokens_per_s / 1e12,
            "comm_mib": (comm_bytes - self._window_comm[0]) / 2**20, "comm_s": comm_seconds - self._window_comm[1],
            "host_peak_mib": host_peak_bytes() / 2**20, "device_peak_mib": self.world.device_policy.peak_bytes() / 2**20,
            "loss_scale": self.loss_scaler.scale, "skipped_steps": self.skipped_steps,
        }
        if self.config.wall_clock_breakdown:
            record.update({f"{k}_s": v for k, v in self._timers.take().items()})
        if self.config.activation_checkpointing.profile:
            profile = (self.checkpointing or activation_checkpointing.current()).take_profile()
            record.update({"checkpoint_regions": profile.regions, "checkpoint_forward_s": profile.forward_s,
                           "checkpoint_recomputations": profile.recomputations,
                           "checkpoint_recompute_s": profile.recompute_s})
        self._window_start, self._window_steps, self._tokens = now, self.global_steps, 0
        self._window_comm = (comm_bytes, comm_seconds)
        return record

    # ------------------------------------------------------------------ DeepSpeed-style accessors
    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        self.module.eval()
        return self

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        """The gradient norm of the last optimizer step, before clipping (same on every rank)."""
        return self._grad_norm

    def train_batch_size(self) -> int:
        assert self.config.train_batch_size is not None
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        assert self.config.train_micro_batch_size_per_gpu is not None
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        assert self.config.gradient_accumulation_steps is not None
        return self.config.gradient_accumulation_steps

    @property
    def stage(self) -> int:
        return self.strategy.stage


    # ------------------------------------------------------------------ accounting
    def memory_breakdown(self) -> dict[str, float]:
        """Bytes this rank holds, by category (see [Note: what the breakdown counts] in planning/accounting.py)."""
        return memory_breakdown(self.strategy, self.updater, self.precision, self.frozen_params, self.module,
                                self.expert_parallel_size)
