"""The training engine: forward, backward, step, gradient accumulation, clipping and accounting.

The engine only wires parts together and keeps the step counters; what ZeRO does to gradients and
parameters lives in the stage's :class:`~zeroshard.sharding.ShardingStrategy`, the optimizer step in
:class:`~zeroshard.engine.optimizer_step.OptimizerStep`, what a checkpoint saves in
:class:`~zeroshard.engine.checkpoints.EngineCheckpointer`, the metrics in
:class:`~zeroshard.engine.metrics.EngineMetrics`: parts the engine owns.  What differs between jobs
(the gradient norm, a rank's slice of the model) are parts chosen from the axes
(:class:`~zeroshard.engine.parts.EngineParts`), and names the engine does not define are answered by
the facade registered with :func:`~zeroshard.engine.parts.register_extra_names` (DeepSpeed's accessors).

[Note: loss scaling for accumulation]
``engine.backward(loss)`` divides the loss by ``gradient_accumulation_steps`` exactly once, as
DeepSpeed does, so a script passes the plain per-micro-batch mean loss.  Gradients are averaged over
ranks by the reduction, so micro batch 4 x accumulation 1 and micro batch 1 x accumulation 4 give
the same update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

from ..activations import checkpointing as activation_checkpointing
from ..config import ZeroshardConfig
from ..config.schema import ActivationCheckpointingConfig
from ..distributed.collectives import Collectives
from ..distributed.consistency import Call, ConsistencyCheck, EngineUsageError
from ..distributed.parallel_dims import ParallelDims
from ..distributed.topology import Topology, build_shard_groups
from ..distributed.world import World, release_at_exit
from ..sharding.stage3.leaf_config import mark_configured_leaves
from .metrics import EngineMetrics, StepReadings
from ..host.host_allocator import HostMemoryPolicy
from ..host.page_memory import HostPageMemory
from ..experts.groups import ExpertGroupRecord, ExpertParallelError, register_expert_groups
from ..experts.checkpoint import ExpertPlacement, with_every_expert
from ..experts.layer import bind_expert_groups, checked_expert_axis, expert_parallel_size
from .accessors import EngineAccessors
from .memory import memory_breakdown
from .saved_activations import SavedActivations
from ..experts.registry import is_expert_param
from ..optim.param_groups import TrainableParams, collect_trainable
from ..optim.muon import config_split, read_marks
from ..optim.no_optimizer import NoOptimizer, no_optimizer_error
from ..optim.updaters import build_updater
from ..offload.policy import OffloadPolicies
from ..host.buffer_memory import BufferMemory, DeviceMemory
from ..sharding.storage import InitialValues
from ..sharding.unused_params import refuse_unused_parameters
from ..sequence.groups import register_sequence_groups
from ..sequence.inputs import check_sequence_inputs
from ..precision import LossScaler, PrecisionPolicy
from .counters import Counter, TrainingCounters
# ModelAlreadyWrappedError, ModelChangedError and register_extra_names are also the engine's names at this path
from .lifetime import ENGINE_OF, ModelAlreadyWrappedError, ModelChangedError, check_unchanged, refuse_a_wrapped_model
from .placement import FromInit, adopt_init_parameters, defer_to_device, keep_frozen_whole
from ..checkpoint.background import BackgroundSaves
from ..checkpoint.interface import CheckpointParts
from ..sharding import STRATEGIES
from .compile import Backend, compile_options
from .checkpoints import Attached, CheckpointSettings, EngineCheckpointer, TrainingParts
from .optimizer_setup import SchedulerSpec, lr_schedule, optimizer_over_pieces
from .optimizer_step import OptimizerStep
from .parts import EngineParts, ExtraNames, WholeModel, extra_names_of, register_extra_names

class Engine(EngineAccessors):
    """Wraps a model for ZeRO data-parallel training; use it like DeepSpeed's engine.

    This class holds what training does.  Checkpoints are :attr:`checkpointer`'s
    (:class:`~zeroshard.engine.checkpoints.EngineCheckpointer`; the engine's checkpoint methods hand
    over to it), the optimizer step :attr:`optimizer_step`'s, the metrics :attr:`metrics`'; the
    gradient norm and this rank's slice of the model are the parts it was built with (``parts``: see
    [Note: an engine composed of parts] in engine/parts.py), and DeepSpeed's accessor names
    (``fp16_enabled()``, ``zero_optimization_stage()``, attribute forwarding to the module, ...) are
    answered by the facade zeroshard/deepspeed registers (see [Note: DeepSpeed's names on the engine]).
    """
    _compiled = False  # until compile()

    global_steps = Counter()
    micro_steps = Counter()
    global_samples = Counter()
    skipped_steps = Counter()

    def __init__(self, model: nn.Module, config: ZeroshardConfig, world: World,
                 model_parameters: Any = None, optimizer: Any = None,
                 lr_scheduler: SchedulerSpec = None, parts: EngineParts = EngineParts(), *,
                 axes: Optional[ParallelDims] = None) -> None:
        """Take ``model`` over (see [Note: an engine's lifetime] in engine/lifetime.py), with ``parts``
        chosen from the job's axes.  ``axes``: the job's parallel axes, ``world`` their ZeRO world
        (``initialize()`` builds them); by default ``world``'s alone.

        [Note: the order an engine is built in]
        Each step uses what the steps before it built: the policies the config decides; the world
        and the groups the state is sharded over; every rank starting from rank 0's values (the
        storage copies them in); the strategy with its storage, then the parameters it leaves whole;
        the gradient norm over the strategy's buckets; the updater over them, the optimizer over the
        updater's pieces, the LR schedule over the optimizer and the optimizer step over all of these;
        the per-step state and metrics; last the parts that read all of these (the checkpointer,
        DeepSpeed's names); then the take-over, after which the collectives'
        byte counts start from zero (set-up is not training traffic).
        """
        refuse_a_wrapped_model(model)
        # the config's leaf modules, marked before stage 3 plans its units from the marks
        mark_configured_leaves(model, config.zero_optimization.leaf_module)
        muon_marks = read_marks(model)  # the user's use_muon marks, before Init's parameters are swapped
        replaced, from_init = adopt_init_parameters(model, config, world.device)
        self._built_under_init = bool(replaced)
        #: hooks of a set-up on the model (``hold_hook``), removed with the engine's own
        self._held_hooks: list[Any] = []
        #: where this rank's model is a slice of a larger one (checkpoints, full weights)
        self.model_slice = parts.model_slice
        if STRATEGIES[config.stage].traits.shards_parameters:
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
        trainable = config_split(trainable, config.optimizer if optimizer is None else None, muon_marks, replaced)
        self.param_names = trainable.names
        self._sync_initial_state(from_init)
        self._build_storage_and_strategy(trainable, from_init)
        self.frozen_params = keep_frozen_whole(trainable.frozen, from_init, self.module, self.precision)
        self._build_optimizer(optimizer, trainable.group_options, lr_scheduler, parts)
        self._reset_step_state()
        self.metrics = EngineMetrics(config, self.world, self.comm, self.checkpointing)
        self._build_parts(parts)
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
        plain = not (zero.mics_shard_size > 0 or zero.zero_hpz_partition_size > 1 or world.parts)
        self.expert_parallel_size = checked_expert_axis(self.module, self.parallel_dims.ep, plain,
                                                        self._built_under_init)
        self.shard_groups = build_shard_groups(self.comm, self.topology, self.parallel_dims,
                                               STRATEGIES[self.config.stage].traits.gathers_in_passes,
                                               zero.zero_quantized_gradients)
        bind_expert_groups(self.module, self.shard_groups.expert_parallel, self.comm)
        exchange, experts_data = self.shard_groups.expert_parallel, self.shard_groups.expert_data
        #: DeepSpeed's deepspeed.utils.groups answers with these while the engine lives
        self._expert_groups = register_expert_groups(self.expert_parallel_size, ExpertGroupRecord(
            exchange, experts_data, self.comm)) if exchange is not None and experts_data is not None else None
        #: DistributedAttention and deepspeed.utils.groups use this sequence group while the engine lives
        self._sequence_groups = register_sequence_groups(self.shard_groups.sequence, self.comm,
                                                         self.config.sequence_parallel)

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
            [(name_of[id(p)], p) for p in trainable.frozen], buffer_memory=self.buffer_memory, experts=experts,
            interleaved_groups=any("use_muon" in o for o in trainable.group_options))
        self.storage = self.strategy.storage
        self.storage.set_copy_gate(self.saves)  # an asynchronous save's copy

    def _build_optimizer(self, optimizer: Any, options: list[dict[str, Any]], lr_scheduler: SchedulerSpec,
                         parts: EngineParts) -> None:
        """What the optimizer updates and where it lives (see [Note: pieces] in optim/updater.py), the
        optimizer over it, the LR schedule, and the optimizer step with the gradient-norm part."""
        self.updater = build_updater(self.strategy, self.offload)
        self.strategy.add_reduced_listener(self.updater.grad_reduced)
        groups = [{**opts, "params": []} for opts in options]
        for bucket in self.strategy.layout.buckets:
            groups[bucket.group_index]["params"].extend(self.updater.params_of(bucket))
        self.optimizer = optimizer_over_pieces(optimizer, groups, self.config, self.strategy.traits, self.offload)
        self.updater.attach(self.optimizer, sliced=self.parallel_dims.tp > 1)
        setattr(self.optimizer, "overflow", False)
        self.lr_scheduler = lr_schedule(lr_scheduler, self.optimizer, isinstance(optimizer, Optimizer), self.config,
                                        self.module.parameters())
        self.optimizer_step = OptimizerStep(
            self.strategy, self.updater, self.optimizer, self.loss_scaler, self.counters, self.offload, self.comm,
            parts.grad_norm(self.strategy, self.shard_groups, self.world.device), self.param_names,
            self.config.gradient_clipping, self.config.max_consecutive_skips)

    def _reset_step_state(self) -> None:
        """The state of the micro step in progress: a fresh optimizer step at a boundary."""
        # API misuse checks: step() needs a backward() before it; one backward() per boundary
        self._backwards_since_step = 0
        self._boundary_backward_done = False
        # set_gradient_accumulation_boundary(): a caller (Accelerate) that decides the boundary itself
        self._boundary_override: Optional[bool] = None
        #: the last micro step's loss, on the device until a log or metric reads it (see [Note: one host
        #: read per optimizer step] in engine/optimizer_step.py)
        self._last_loss: Optional[torch.Tensor] = None
        #: the bytes a measured forward leaves saved for backward (``measure_activations()``)
        self.saved_activations = SavedActivations()

    def _build_parts(self, parts: EngineParts) -> None:
        """The parts built over the engine: the checkpointer and the facade of extra names (DeepSpeed's).

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
        whole: Optional[WholeModel] = self.model_slice.whole_model()
        if whole is None and experts is not None:  # every rank's experts gathered under their global names
            whole = lambda state, keep: with_every_expert(state, experts, keep)  # noqa: E731
        training = TrainingParts(self.module, self.param_names, self.strategy, self.updater, self.optimizer,
                                 self.loss_scaler, self.counters, experts, whole, self.model_slice.tensor_slice())
        settings = CheckpointSettings.from_config(self.config, self.strategy.traits, self.precision, self.offload,
                                                  parts.saves_periodically)
        self.checkpointer = EngineCheckpointer(
            training, self.world, self.comm, self._agree, self.saves, settings,
            attached=lambda: Attached(engine.lr_scheduler, engine.data_loader),
            resume_at_boundary=lambda: engine._resume_at_boundary())
        self._extra_names: Optional[ExtraNames] = extra_names_of(engine)

    def _take_over(self) -> None:
        """Register the engine as the model's (see [Note: an engine's lifetime] in engine/lifetime.py) and
        as one to release at exit; the traffic of set-up is not training traffic."""
        self.comm.reset_counters()
        #: the parameters' names as the engine took them over (see ``check_unchanged``)
        self._parameter_names = [name for name, _ in self.module.named_parameters()]
        self._closed = False
        ENGINE_OF[self.module] = weakref.ref(self)
        release_at_exit(self._release_at_exit)

    def __getattr__(self, name: str) -> Any:
        """[Note: DeepSpeed's names on the engine]
        DeepSpeed's accessors (``engine.fp16_enabled()``, ``engine.local_rank``, ...) and, as in
        DeepSpeed, any attribute of the wrapped module (``engine.generate(...)``) are reached on the
        engine.  The engine answers every name it does not define itself with its facade of extra
        names (``answer``), which zeroshard/deepspeed/engine_api.py registers when it is imported
        (``register_extra_names``; ``import zeroshard`` imports it): ``DeepSpeedEngineAPI``, which has
        DeepSpeed's accessor of that name or hands the lookup on to the module.  One fallback, where
        naming each of some thirty accessors again here would give the engine DeepSpeed's vocabulary
        (see [Note: one thin layer for DeepSpeed's names] in deepspeed/engine_api.py), and the engine
        imports nothing of zeroshard/deepspeed.  What the engine defines comes first, so none of its
        own names is ever a module's.
        """
        facade = self.__dict__.get("_extra_names")
        if facade is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")
        return facade.answer(name)

    # ------------------------------------------------------------------ the training step
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        check_unchanged(self.module, self._parameter_names)
        if self.strategy.traits.forward_communicates:
            self._agree.agree(Call.FORWARD, self.micro_steps, self.global_steps)
        check_sequence_inputs(self.shard_groups.sequence, args, kwargs)
        self.strategy.before_forward()
        tokens = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if tokens is not None and not tokens.is_floating_point() and torch.is_grad_enabled():
            self.metrics.tokens += tokens.numel()  # token ids: counted for tokens/s and TFLOP/s
        if self.precision.mixed:  # floating-point inputs meet the 16-bit weights in their dtype
            args = tuple(self._to_compute(a) for a in args)
            kwargs = {k: self._to_compute(v) for k, v in kwargs.items()}
        checkpointing = contextlib.nullcontext() if self.checkpointing is None else \
            activation_checkpointing.using(self.checkpointing)
        with checkpointing, self.saved_activations.recording(self.module):
            output = self.module(*args, **kwargs)
        self.metrics.timers.add("forward", started)
        return output

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
        if not self.config.zero_optimization.ignore_unused_parameters:  # every rank, after the backward's collectives
            refuse_unused_parameters(self.comm, self.strategy.unused)
        self._last_loss = loss.detach()
        self.optimizer_step.saw_loss(self._last_loss)
        self.metrics.timers.add("backward", started)
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
            self.optimizer_step.run(self.lr_scheduler)
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self.saves.stepped()  # an asynchronous save spread over steps writes its next share
            self.host_memory.after_step()  # the step's activations and gradients are freed by now
        self.micro_steps += 1
        self.metrics.timers.add("step", started)
        if boundary:
            self.checkpointer.save_periodically()
        if self.micro_steps % self.gradient_accumulation_steps() == 0 and \
                self.global_steps % self.config.steps_per_print == 0:
            self.metrics.log_progress(self._readings())

    def hold_hook(self, handle: Any) -> None:
        """A hook of a set-up on the model (the tensor-parallel batch check), removed with the engine's own."""
        self._held_hooks.append(handle)

    def _release_at_exit(self) -> None:
        """See [Note: a clean exit] in distributed/world.py: no collective here (a rank may be gone)."""
        self.saves.release()
        self._release(hand_back=False)
        self._agree.release()
        self.shard_groups.release()

    def close(self) -> None:
        """Hand the model back and release what the engine holds (see [Note: an engine's lifetime] in
        engine/lifetime.py).

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
        for handle in self._held_hooks:
            handle.remove()
        self._held_hooks = []
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
        ENGINE_OF.pop(self.module, None)

    def zero_grad(self) -> None:
        """Drop gradients accumulated so far. ``step()`` already does this after each update."""
        self.strategy.zero_grad()
        for p in self.strategy.params:
            p.grad = None

    # ------------------------------------------------------------------ checkpoints and full weights
    def save_checkpoint(self, save_dir: Union[str, Path], tag: Any = None, client_state: Any = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: Optional[bool] = None, format: Optional[str] = None) -> Path:
        """Write a sharded checkpoint under ``save_dir/tag`` (checkpoint/format.py); returns that directory.

        ``tag`` may be of any type (DeepSpeed scripts pass step numbers): it names a directory by
        ``str(tag)``.  ``exclude_frozen_parameters`` leaves frozen parameters out (a LoRA job's base
        model, which the job loads from its pretrained weights anyway); a load then keeps the model's
        current frozen values.  ``async_save`` (default: ``checkpoint.writer.decoupled``): return at once;
        the state is copied (the next optimizer step waits for that), written and published in the
        background (see [Note: asynchronous saves] in checkpoint/background.py).  ``format``: the layout,
        ``"zeroshard"`` or ``"deepspeed"`` (DeepSpeed's files; default: ``checkpoint.format``).
        """
        return self.checkpointer.save(self.model_slice.save_directory(save_dir), tag, client_state, save_latest,
                                      exclude_frozen_parameters, async_save, layout=format)

    def wait_for_checkpoint(self) -> Optional[Path]:
        """Block until the asynchronous save in flight is published; returns its directory (None when
        none was in flight).  Raises its error, on every rank, if it failed."""
        return self.saves.wait()

    def load_checkpoint(self, load_dir: Union[str, Path], tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, load_rng_state: Optional[bool] = None,
                        ) -> tuple[Optional[Path], Any]:
        """Load a checkpoint saved at any world size and stage; returns ``(path, client_state)``.

        ``load_rng_state``: whether torch's RNG states are restored (see [Note: who owns the random
        number generators on resume] in engine/checkpoints.py).  The engine resumes at a step
        boundary, with its own accumulation (see :meth:`_resume_at_boundary`).
        """
        return self.checkpointer.load(self.model_slice.load_directory(load_dir), tag, load_module_strict,
                                      load_optimizer_states, load_lr_scheduler_states, load_module_only, load_rng_state)

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
        self.optimizer_step.nonfinite_loss = None

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
        self.model_slice.check_full_weights()
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

    def metrics_record(self) -> dict[str, Any]:
        """The metrics since the previous record (resets the window)."""
        return self.metrics.record(self._readings())

    @property
    def last_metrics(self) -> Optional[dict[str, Any]]:
        """The record of the last ``steps_per_print`` log line (None before the first)."""
        return self.metrics.last

    def _readings(self) -> StepReadings:
        return StepReadings(self.global_steps, self._last_loss, self.get_lr()[0], self.optimizer_step.grad_norm,
                            self.train_batch_size(), self.strategy.layout.numel, self.loss_scaler.scale,
                            self.skipped_steps)

    # ------------------------------------------------------------------ compilation
    def compile(self, backend: Backend = "inductor", compile_kwargs: Optional[dict[str, Any]] = None,
                schedule: Any = None) -> None:
        """Compile the wrapped module in place ([Note: compiling the engine's module in place] in engine/compile.py)."""
        self.module.compile(**compile_options(backend, compile_kwargs, schedule, self.stage, self.parallel_dims))
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._compiled

    # ------------------------------------------------------------------ accounting
    def memory_breakdown(self) -> dict[str, float]:
        """Bytes this rank holds, by category (see [Note: what the breakdown counts] in planning/accounting.py),
        with ``activations`` once a forward was measured (``measure_activations()``)."""
        return {**memory_breakdown(self.strategy, self.updater, self.precision, self.frozen_params, self.module,
                                   self.expert_parallel_size), **self.saved_activations.breakdown()}

    def measure_activations(self) -> contextlib.AbstractContextManager[None]:
        """Inside this block, each forward's saved-for-backward bytes are measured; ``memory_breakdown()``
        reports the last as ``activations`` (see [Note: what the measured activations count] in
        engine/saved_activations.py)."""
        return self.saved_activations.measuring(self._compiled)
