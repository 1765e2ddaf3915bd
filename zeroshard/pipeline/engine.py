"""The pipeline engine: one stage's ZeRO engine, driven a batch at a time by a schedule.

[Note: ZeRO inside a pipeline stage]
Each stage is an ordinary zeroshard :class:`~zeroshard.engine.engine.Engine` over its own
data-parallel ranks (distributed/parallel_dims.py), at any ZeRO stage; the pipeline engine is that
engine with a batch-level driver on top.  Every micro-batch's backward goes through the engine's
``backward()`` and ``step()``, so the engine's own accumulation does what ZeRO needs: gradients are
reduced over the data-parallel group once, in the backward of the batch's last micro-batch, and the
optimizer steps once, right after it.  Two things are the pipeline's: the gradient norm is summed
over the stages before clipping (the engine's norm is its stage's; tied weights are counted on their
owner only, see [Note: tied weights across stages] in pipeline/tied.py), and the loss of each
micro-batch exists on the last stage only, so an earlier stage backpropagates the gradient it
receives (pipeline/executor.py).  At ZeRO stage 3 the stage's parameters are gathered once per
batch and kept through its micro-batches' passes, unless ``pipeline.stage3_gather_per_micro_batch``
asks for a gather per micro-batch and pass (see [Note: a stage's parameters gathered once per batch]).

[Note: three axes]
With ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` each stage's ranks form ``num_dp``
tensor-parallel groups of ``num_mp`` neighbours (distributed/parallel_dims.py): the ranks of a group
build the same layers, and the engine splits the stage's linear layers over the group as
``tensor_parallel.autotp_size`` does for a plain model (tensor_parallel/split.py), before the stage's
ZeRO engine takes the parameters.  Each tensor index of a stage then trains over its own data-parallel
group, each (data, tensor) index has its own pipeline, whose stages pass activations (replicated over
the tensor group, each rank sending its own copy to its counterpart), and the gradient norm is the
stage's over its tensor group (split parts once, replicated parameters once) summed over the stages.

[Note: a stage's parameters gathered once per batch]
Outside a pipeline, stage 3 gathers each unit for a forward and again for its backward, and releases
it after each (sharding/stage3/gather_scheduler.py).  A pipeline stage runs ``m`` forwards and ``m``
backwards per batch, so that would be ``2m`` all-gathers of each unit per batch, for parameters that do
not change until the batch's step.  By default (``pipeline.stage3_gather_per_micro_batch`` false) the
stage pins every unit of its engine gathered before the batch's first pass, the mechanism
``GatheredParameters`` uses (``ShardedParameters.pin``): the scheduler's hooks still run, find the units
gathered and leave them so, and since every unit is pinned no rank starts a gather round (see
``GatherScheduler.finish_pass``).  Every rank of the stage's data-parallel group pins the same units in
the same order, so their all-gathers pair up.  The units are unpinned, and so released, after the
batch's last backward and before its optimizer step (the step updates the shards, which the gathered
copies would no longer match), or when the batch fails.  Gradients are reduced as without pinning:
once, in the last backward.  The cost is memory: the stage's full parameters stay on each of its ranks
for the whole batch, beside the activations the schedule keeps; ``stage3_gather_per_micro_batch: true``
goes back to a gather per unit and pass where that memory is short.  torchtitan does likewise with
FSDP2 under a pipeline (no resharding after forward, to avoid an all-gather per micro-batch).

[Note: the loss scale along a pipeline]
Under fp16 the loss is multiplied by the loss scale once, on the last stage, by its engine's
``backward()`` (with the division by the accumulation steps), so every gradient that travels back
already carries the scale.  An earlier stage's backward starts from those gradients: the scalar it
hands its engine (the vector-Jacobian product as one sum) goes through :class:`_ReceivedGradients`,
whose gradient is 1 whatever the engine multiplies it by, so the scale is not applied a second
time.  Each stage's engine keeps its own loss scaler, and they stay equal: whether a step overflows
is read from the gradient norm, which is summed over the stages (``StagesNorm``) as well as over
the stage's data-parallel ranks, so an inf or NaN on any rank of any stage makes every rank of the
job skip the same step and lower its scale the same way.  The losses ``train_batch`` returns are the
loss function's own, never scaled.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch

from ..config import ZeroshardConfig
from ..distributed.collectives import Collectives
from ..distributed.consistency import EngineUsageError
from ..distributed.parallel_dims import ParallelDims
from ..engine.engine import Engine, SchedulerSpec
from ..engine.parts import EngineParts
from ..logging import log_rank
from ..sharding.stage3.gather_scheduler import GatherScheduler
from ..sharding.stage3.gathered import GatheredParameters
from ..sharding.stage3.units import unit_label
from ..checkpoint.format import CheckpointError
from ..checkpoint.interface import CheckpointParts
from ..tensor_parallel import SplitModel, split_stage
from ..tensor_parallel.engine import tensor_parallel_parts
from ..tensor_parallel.slices import TensorAxis, TensorSlice
from .checkpoint import job_parts, load_pipeline, periodic_save_due, prune_periodic, save_pipeline
from .checks import pipeline_config
from .executor import BatchRun, BatchTiming, StageClock, batches_from
from .module import PipelineModule
from .norm import StagesNorm
from .p2p import StageLink
from .schedule import SCHEDULES, ForwardOnly, PipeSchedule


class PipelineUsageError(EngineUsageError):
    """A data-parallel call (``forward``/``backward``/``step``) on a pipeline engine, which trains a batch
    at a time (``train_batch``), or a feature pipelining does not have yet."""


class PipelineEngine(Engine):
    """Trains a :class:`PipelineModule`: ``train_batch()`` and ``eval_batch()``, DeepSpeed's names."""

    def __init__(self, module: PipelineModule, config: ZeroshardConfig, model_parameters: Any = None,
                 optimizer: Any = None, lr_scheduler: SchedulerSpec = None, *,
                 axes: Optional[ParallelDims] = None) -> None:
        config = pipeline_config(config, module)
        self.pipeline_groups = groups = module.groups
        #: tensor parallelism inside each stage: how its linear layers were split (None: not split)
        self.split: Optional[SplitModel] = None
        if groups.dims.tp > 1:  # see [Note: three axes] in pipeline/engine.py
            self.split = split_stage(module, config.tensor_parallel, groups)
        #: the gradient norm summed over the stages (see [Note: ZeRO inside a pipeline stage])
        self.stages_norm = StagesNorm(groups.pipe, groups.dims.pp)
        #: with tensor parallelism: this rank's slice of the stage, under the layers' global names
        self.tensor_slices: Optional[TensorSlice] = None
        # a periodic save is the whole pipeline's, after the batch (``_save_periodically``), never one
        # stage's engine's in the middle of the batch
        parts = EngineParts(norm_across=self.stages_norm, saves_periodically=False)
        if self.split is not None:  # the tensor-parallel parts of a plain model, under the job's names
            assert groups.tensor is not None
            self.tensor_slices = TensorSlice(TensorAxis(groups.tensor, groups.tensor_index, self.split.size,
                                                        self.split, module.global_name))
            parts = tensor_parallel_parts(self.tensor_slices, self.stages_norm, saves_periodically=False)
        super().__init__(module, config, groups.data_world, model_parameters, optimizer, lr_scheduler, parts,
                         axes=axes)
        log_rank(groups.describe())
        self.pipe: Collectives = groups.pipe
        #: the ranks that save one checkpoint together: every rank, or those of one tensor index (see [Note:
        #: a pipeline of tensor-parallel stages in a checkpoint] in pipeline/checkpoint.py)
        self.job_comm = Collectives(groups.tensor_slice if groups.tensor_slice is not None else groups.world)
        #: every rank of the job
        self.world_comm = Collectives(groups.world)
        self.num_stages = groups.dims.pp
        self.stage_id = groups.stage
        self.schedule: PipeSchedule = SCHEDULES[config.pipeline.schedule]
        #: chunks of the model on this rank (``PipelineModule(virtual_stages=...)``, the interleaved schedule)
        self.chunks = module.virtual_stages
        self.link = StageLink(groups.p2p, groups.stage, groups.dims.pp, self.world.device, groups.p2p_gradients)
        self.data_iterator: Optional[Iterator[Any]] = None
        #: applied to every micro-batch read (``set_batch_fn``)
        self.batch_fn: Optional[Callable[[Any], Any]] = None
        #: the iterator over ``initialize(training_data=...)``'s loader, once train_batch() made it
        self.loader_iterator: Optional[Iterator[Any]] = None
        #: where this rank's time went in its last ``train_batch`` (see [Note: the measured bubble] in
        #: pipeline/executor.py); None before the first
        self.last_batch_timing: Optional[BatchTiming] = None
        #: stage 3: the units held gathered for a batch (see [Note: a stage's parameters gathered once
        #: per batch]); empty below stage 3 or per micro-batch
        self.batch_gathers = BatchGathers(None if config.pipeline.stage3_gather_per_micro_batch
                                          else self.strategy.gather_scheduler())
        if self.precision.mixed:  # see [Note: tied copies under mixed precision] in pipeline/tied.py
            module.tied.use_compute_dtype(self.precision.compute)
            module.tied.broadcast_from_owners(self._full_values)

    # ------------------------------------------------------------------ where this rank is
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator of ``(inputs, labels)`` micro-batches the first and last stages read."""
        self.data_iterator = iterator

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Every micro-batch read from the iterator goes through ``fn`` first (it returns
        ``(inputs, labels)``), as DeepSpeed's pipeline engine does."""
        self.batch_fn = fn

    # ------------------------------------------------------------------ refused data-parallel calls
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineUsageError("a pipeline engine runs whole batches: call engine.train_batch(data_iter) (or "
                                 "eval_batch) instead of engine(inputs) / forward()")

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True, retain_graph: bool = False) -> torch.Tensor:
        raise PipelineUsageError("a pipeline engine runs whole batches: call engine.train_batch(data_iter) instead "
                                 "of backward()")

    def step(self) -> None:
        raise PipelineUsageError("a pipeline engine runs whole batches: call engine.train_batch(data_iter) instead "
                                 "of step()")

    def measure_activations(self) -> Any:
        raise PipelineUsageError("measure_activations() measures engine(inputs) / forward(), which a pipeline "
                                 "engine does not run; its micro-batches' activations are not measured")

    # ------------------------------------------------------------------ checkpoints (pipeline/checkpoint.py)
    def save_checkpoint(self, save_dir: Union[str, Path], tag: Any = None, client_state: Any = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: Optional[bool] = None, format: Optional[str] = None) -> Path:
        """One checkpoint of the whole pipeline, keyed by the layers' global names (every rank calls it);
        it loads at any pipeline depth, data-parallel degree and ZeRO stage.  Written synchronously, in
        zeroshard's layout."""
        if async_save:
            raise PipelineUsageError("save_checkpoint(async_save=True): a pipelined model's checkpoints are "
                                     "written synchronously (docs/PIPELINE.md)")
        if (format or self.config.checkpoint.format) != "zeroshard":
            raise PipelineUsageError("save_checkpoint: a pipelined model's checkpoints are written in zeroshard's "
                                     "layout (DeepSpeed's is written for one data-parallel group)")
        tag_name = f"global_step{self.global_steps}" if tag is None else str(tag)
        slices = self.tensor_slices
        if slices is not None:  # see the Note in pipeline/checkpoint.py: every stage's split parameters
            dims = {k: v for stage in self.world_comm.all_gather_json(slices.job_dims(), "tensor_split")
                    for k, v in stage.items()}
            slices.record_split(Path(save_dir), dims)
        return save_pipeline(self._job_parts(), self.config.checkpoint, self._part_of(save_dir), tag_name, client_state,
                             save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: Union[str, Path], tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, load_rng_state: Optional[bool] = None,
                        ) -> tuple[Optional[Path], Any]:
        """Load a checkpoint saved by a pipeline of any split; returns ``(path, client_state)``."""
        restore_rng = self.data_loader is not None if load_rng_state is None else load_rng_state
        failed: Optional[BaseException] = None
        try:
            loaded = load_pipeline(self._job_parts(), load_dir, tag, load_module_strict, load_optimizer_states,
                                   load_lr_scheduler_states, load_module_only, restore_rng)
        except Exception as error:  # [Note: a pipeline of tensor-parallel stages in a checkpoint] in
            # pipeline/checkpoint.py: every rank of the job learns whether each load succeeded
            if self.split is None:
                raise
            failed = error
        if self.split is not None:
            failures = torch.tensor([float(failed is not None)], device=self.world.device)
            self.world_comm.all_reduce(failures, "checkpoint_load_failures")
            if failed is not None:
                raise failed
            if float(failures.item()) > 0:
                raise CheckpointError(f"load_checkpoint({str(load_dir)!r}): another tensor-parallel rank's load "
                                      f"failed (its error names why); nothing was loaded on any rank that "
                                      f"reads on")
        self._resume_at_boundary()
        self._module().tied.broadcast_from_owners(self._full_values)
        if self.data_iterator is not None and self.data_iterator is self.loader_iterator:
            self.data_iterator = None  # the next batch starts where the loaded loader position says
        return loaded

    def _part_of(self, directory: Union[str, Path]) -> Path:
        """Where this rank's tensor index saves: the directory, or its ``mp_rank_XX`` part."""
        return Path(self.model_slice.own_directory(directory))

    def _save_periodically(self) -> None:
        """``checkpoint.save_interval``: the whole pipeline's checkpoint ``global_step<N>`` in
        ``checkpoint.save_dir``, every rank of the job at the same step, after the batch (its tied
        copies refreshed, every message sent); then the oldest beyond ``keep_last`` are pruned."""
        settings = self.config.checkpoint
        if periodic_save_due(settings, self.global_steps):
            assert settings.save_dir is not None
            self.save_checkpoint(settings.save_dir)
            prune_periodic(settings, self._part_of(settings.save_dir), self.job_comm.world.is_main)

    def _job_parts(self) -> CheckpointParts:
        return job_parts(self.checkpoint_parts(), self._module(), self.param_names, self.job_comm)

    # ------------------------------------------------------------------ the stage's passes (executor.StagePasses)
    def stage_forward(self, inputs: Any, chunk: int) -> Any:
        return super().forward(inputs, chunk=chunk) if self.chunks > 1 else super().forward(inputs)

    def stage_backward(self, value: torch.Tensor, is_loss: bool, boundary: bool) -> None:
        # the executor knows which backward is the batch's last on this rank; with chunks, a micro-batch
        # has one backward per chunk and the engine's count of micro steps cannot tell
        self.set_gradient_accumulation_boundary(boundary)
        if is_loss:
            super().backward(value)
        else:  # see [Note: the loss scale along a pipeline]
            super().backward(_ReceivedGradients.apply(value), scale_wrt_gas=False)

    def stage_last_backward_done(self) -> None:
        self.batch_gathers.release()  # before the step changes the shards

    def stage_step(self) -> None:
        super().step()
        self.set_gradient_accumulation_boundary(None)

    # ------------------------------------------------------------------ batches
    def _module(self) -> PipelineModule:
        assert isinstance(self.module, PipelineModule)
        return self.module

    def _iterator(self, data_iter: Optional[Iterator[Any]]) -> Optional[Iterator[Any]]:
        if data_iter is not None:
            self.data_iterator = data_iter
        if self.data_iterator is None and self.data_loader is not None:
            # the loader samples over the data-parallel ranks: every stage of one reads the same samples
            self.data_iterator = self.loader_iterator = iter(_Repeating(self.data_loader))
        return self.data_iterator

    def train_batch(self, data_iter: Optional[Iterator[Any]] = None) -> torch.Tensor:
        """Train one batch of ``gradient_accumulation_steps`` micro-batches; returns its mean loss (over
        micro-batches and data-parallel ranks) on every rank."""
        module = self._module()
        self.module.train()
        micro = self.gradient_accumulation_steps()
        self.stages_norm.clock = clock = StageClock(self.link)
        run = BatchRun(self, self.link, module.tied, micro, batches_from(self._iterator(data_iter), self.batch_fn),
                       module.loss_fn, training=True, clock=clock, chunks=self.chunks)
        try:
            self.batch_gathers.hold()
            result = run.run(self.schedule.actions(self.stage_id, self.num_stages, micro, self.chunks))
            started = time.perf_counter()
            module.tied.broadcast_from_owners(self._full_values)
            clock.synced(started)
            losses = torch.stack(result.losses).mean() if result.losses else None
            started = time.perf_counter()
            loss = self._share_loss(losses, shape=())
            clock.synced(started)
        finally:
            self.batch_gathers.release()  # a batch that raised: nothing stays pinned
            self.stages_norm.clock = None
            self.set_gradient_accumulation_boundary(None)
        self.last_batch_timing = clock.timing()
        self._save_periodically()
        return loss

    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: Optional[str] = "avg", bcast_loss: bool = True,
                   num_micro_batches: Optional[int] = None) -> Any:
        """Evaluate ``num_micro_batches`` (default: the accumulation steps) micro-batches without
        gradients.  The loss is averaged over micro-batches (``reduce_output="avg"``; None: one per
        micro-batch) and data-parallel ranks, and given to every stage (``bcast_loss``; otherwise the
        last stage alone has it).  ``return_logits``: also the last stage's outputs, one per
        micro-batch (None on the other stages)."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        module = self._module()
        micro = num_micro_batches or self.gradient_accumulation_steps()
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                run = BatchRun(self, self.link, None, micro, batches_from(data_iter, self.batch_fn), module.loss_fn,
                               training=False, compute_loss=compute_loss, keep_outputs=return_logits,
                               chunks=self.chunks)
                self.batch_gathers.hold()
                result = run.run(ForwardOnly().actions(self.stage_id, self.num_stages, micro, self.chunks))
        finally:
            self.batch_gathers.release()
            module.train(was_training)
        loss: Any = None
        if compute_loss:
            local = None
            if result.losses:
                stacked = torch.stack(result.losses)
                local = stacked.mean() if reduce_output == "avg" else stacked
            shape: tuple[int, ...] = () if reduce_output == "avg" else (micro,)
            loss = self._share_loss(local, shape) if bcast_loss else self._dp_mean(local)
        logits = result.outputs if self.is_last_stage() else None
        if return_logits:
            return loss, logits
        return loss

    def _dp_mean(self, value: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if value is None or not self.world.is_distributed:
            return value
        summed = value.detach().float().clone()
        self.comm.all_reduce(summed, "pipeline_loss")
        return summed / self.world.world_size

    def _share_loss(self, value: Optional[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """The last stage's loss, averaged over its data-parallel ranks, on every stage."""
        mean = self._dp_mean(value) if self.is_last_stage() else None
        out = mean.float().reshape(shape) if mean is not None else torch.zeros(shape, device=self.world.device)
        if self.num_stages > 1:
            out = out.contiguous()
            self.pipe.broadcast(out, self.num_stages - 1, "pipeline_loss")
        return out

    @staticmethod
    def _full_values(module: torch.nn.Module, attr: str) -> torch.Tensor:
        """The full values of ``module``'s parameter ``attr`` (a gather at ZeRO stage 3: every data-parallel
        rank calls it), read inside the block, where the module holds the parameter itself and not its
        placeholder (see [Note: reading a sharded parameter outside forward] in
        sharding/stage3/placeholder.py)."""
        with GatheredParameters([getattr(module, attr)]):
            return getattr(module, attr).data.detach().clone()


#: the label of a batch's gathers in the collectives log: ``batch_`` + the unit's own (``gather[...]``)
BATCH_LABEL = "batch_"


class BatchGathers:
    """Every stage-3 unit of a stage's engine, held gathered from :meth:`hold` to :meth:`release`."""

    def __init__(self, scheduler: Optional[GatherScheduler]) -> None:
        #: None below ZeRO stage 3: nothing to hold
        self.scheduler = scheduler
        self._pinned: list[int] = []

    @property
    def held(self) -> bool:
        return bool(self._pinned)

    @property
    def units(self) -> list[int]:
        return sorted(self.scheduler.units) if self.scheduler is not None else []

    def hold(self) -> None:
        """Gather every unit for the batch's passes (the all-gathers launched together, then waited for; FP8
        layers' weights in FP8 where stage 3 gathers them so) and pin it."""
        if self.scheduler is None or self.held:
            return
        storage, layout = self.scheduler.storage, self.scheduler.storage.layout
        labels = {i: BATCH_LABEL + unit_label(self.scheduler.units[i], layout) for i in self.units}
        for index in self.units:
            storage.gather(index, labels[index], async_op=True, compute=True)
        for index in self.units:
            storage.pin(index, labels[index], compute=True)  # waits for the gather launched above
            self._pinned.append(index)

    def release(self) -> None:
        """Unpin every unit, which releases it (nothing else holds it); idempotent."""
        if self.scheduler is None:
            return
        pinned, self._pinned = self._pinned, []
        for index in pinned:
            self.scheduler.storage.unpin(index)


class _ReceivedGradients(torch.autograd.Function):
    """The scalar an earlier stage backpropagates, in fp32; its gradient is 1, whatever the engine's
    ``backward()`` multiplies it by (see [Note: the loss scale along a pipeline])."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        ctx.dtype = value.dtype
        return value.detach().float()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.ones((), dtype=ctx.dtype, device=grad.device)


class _Repeating:
    """A loader started over each time it ends (the pipeline reads micro-batches across epochs)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield from self.loader
