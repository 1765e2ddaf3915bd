"""``zeroshard.initialize()``: the DeepSpeed-compatible entry point."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from .config import ConfigError, ZeroshardConfig, load_config, resolve_batch_sizes
from .config.kept_defaults import announce_kept_defaults
from .config.loader import read_config_source
from .engine.data import DistributedLoader, build_loader
from .distributed.launch_env import DEFAULT_PORT
from .distributed.model_parallel import ModelParallelWorlds, check_mpu, model_parallel_worlds
from .distributed.parallel_dims import ParallelDims
from .distributed.world import World, init_distributed
from .checkpoint.format import LATEST
from .engine.engine import Engine, SchedulerSpec
from .errors import InitializeArgumentError
from .experts.layer import expert_parallel_size
from .fp8.checks import refuse_fp8_with, refuse_fsdp_float8_weights
from .fp8.convert import convert_from_config
from .fp8.gathers import fp8_weights, gather_fp8_weights
from .fp8.stages import convert_stages
from .tensor_parallel import SplitModel, prepare_tensor_parallel, tensor_parallel_size
from .tensor_parallel.engine import tensor_parallel_engine
from .logging import log_rank
from .pipeline import PipelineConfigError, PipelineEngine, PipelineModule
from .pipeline.module import PipelineMPU
from .sequence.groups import SequenceParallelError, check_sequence_axes
from .sequence.unit import is_sequence_unit


def initialize(args: Any = None, model: Optional[nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Optional[Dataset] = None,
               lr_scheduler: SchedulerSpec = None, distributed_port: Any = None, mpu: Any = None,
               dist_init_required: Optional[bool] = None, collate_fn: Optional[Callable[..., Any]] = None,
               config: Any = None, config_params: Any = None, mesh_param: Any = None,
               resume_from: Union[str, Path, None] = None,
               ) -> tuple[Engine, torch.optim.Optimizer, Optional[DistributedLoader], Any]:
    """Wrap ``model`` for ZeRO training; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    DeepSpeed's signature.  ``config`` is a path to a DeepSpeed-style JSON file or a dict
    (``config_params``, and ``args.deepspeed_config`` from :func:`add_config_arguments`, are
    DeepSpeed's other spellings).  ``optimizer`` and ``lr_scheduler`` may be objects or callables;
    ``training_data`` gives back a distributed loader at the micro batch size.  Joins the process
    group if nobody has yet, as :func:`zeroshard.init_distributed` does (torchrun's, mpirun's or srun's
    launch; ``distributed_port`` is the master's port when ``MASTER_PORT`` is unset);
    ``dist_init_required=False``: one must exist.
    ``mpu``: the model splits its own layers across tensor-parallel ranks (Megatron's); each rank's
    part is trained with ZeRO over its data-parallel group (docs/DEEPSPEED_AND_HUGGING_FACE.md,
    "Tensor parallelism through mpu").  ``mesh_param`` must be None: sequence parallelism comes from the config's
    ``sequence_parallel_size`` (docs/SEQUENCE_PARALLEL.md), whose ranks see the same samples from the loader.
    A :class:`~zeroshard.pipeline.PipelineModule` model gets a pipeline engine (docs/PIPELINE.md).

    ``resume_from`` (zeroshard's): a checkpoint directory whose ``latest`` checkpoint is loaded, RNG
    included, when it has one (otherwise training starts fresh); ``"latest"`` means the config's
    ``checkpoint.save_dir``, as ``checkpoint.auto_resume: true`` does.  This is how a job restarted by
    torchrun (``--max-restarts``) carries on where it was.
    """
    if model is None:
        positional = " (a module was passed as the first argument, which is args: pass it as model=)" \
            if isinstance(args, nn.Module) else ""
        raise InitializeArgumentError(f"initialize() needs model={positional}")
    if mesh_param is not None:
        raise ValueError("initialize(mesh_param=): a device mesh is not taken; pass None and set the config's "
                         "sequence_parallel_size for sequence parallelism")
    sequence_unit = mpu if is_sequence_unit(mpu) else None
    if sequence_unit is not None:
        mpu = None  # a sequence-parallel unit (the Hugging Face path's) says the sequence degree, no model split
    if mpu is not None and not isinstance(model, PipelineModule):
        check_mpu(mpu)  # before anything else: a wrong object is named at once
    source = _config_source(config, config_params, args)
    parsed: ZeroshardConfig = load_config(source)
    if sequence_unit is not None:
        parsed = _sequence_degree_of(sequence_unit, parsed)
    if not isinstance(source, ZeroshardConfig):  # see [Note: a default that DeepSpeed moved] in config/kept_defaults.py
        announce_kept_defaults(read_config_source(source))
    # the launch as zeroshard.init_distributed() reads it; a group created before (by it or the user) is kept
    world = init_distributed(timeout_s=parsed.collective_timeout, port=int(distributed_port or DEFAULT_PORT),
                             must_exist=dist_init_required is False)
    if parsed.collectives_in_a_world_of_one:
        world = _issuing_collectives_at_one(world)
    if not isinstance(model, PipelineModule) and (parsed.pipeline.stages or 1) > 1:
        raise PipelineConfigError(f"'pipeline.stages' = {parsed.pipeline.stages} needs the model as a "
                                  f"zeroshard.pipe.PipelineModule (docs/PIPELINE.md)")
    refuse_fsdp_float8_weights(model)
    if parsed.fp8.enabled:  # FP8 is refused, or converted, on every rank before the engine is built
        refuse_fp8_with(_tensor_parallel_degree(parsed, model, mpu))
        if isinstance(model, PipelineModule):  # see [Note: FP8 layers in a pipeline] in fp8/stages.py
            convert_stages(model, parsed.fp8)
        else:
            convert_from_config(model, parsed.fp8)
    if isinstance(model, PipelineModule):
        if mpu is not None and not (isinstance(mpu, PipelineMPU) and mpu.describes(model)):
            raise PipelineConfigError("initialize(mpu=...) with a PipelineModule: only the module's own "
                                      "model.mpu(); a pipeline of tensor-parallel stages is not supported yet")
        return _initialize_pipeline(model, parsed, model_parameters, optimizer, lr_scheduler, training_data,
                                    collate_fn, resume_from)
    split: Optional[SplitModel] = None
    worlds: Optional[ModelParallelWorlds] = None
    batch_check: Any = None
    if mpu is not None:
        if parsed.tensor_parallel.autotp_size > 1:
            raise ValueError("initialize(mpu=...) with tensor_parallel.autotp_size: the model splits its own layers "
                             "(mpu) or zeroshard splits them (autotp_size), not both")
        worlds = model_parallel_worlds(mpu, world)
        axes = _job_axes(parsed, world, worlds.dims.tp, model, model_parallel=True)
        worlds = dataclasses.replace(worlds, dims=axes)
    else:  # tensor parallelism from the config, or from tp_model_init() (zeroshard/tensor_parallel/)
        axes = _job_axes(parsed, world, tensor_parallel_size(model, parsed.tensor_parallel), model)
        if sequence_unit is not None:
            _check_unit_layout(sequence_unit, axes, world)
        prepared = prepare_tensor_parallel(model, parsed.tensor_parallel, world, axes)
        if prepared is not None:
            worlds, mpu, split, batch_check = prepared
    if worlds is not None:
        world = worlds.data_world  # batch sizes and the loader are per data-parallel rank
    parsed = resolve_batch_sizes(parsed, world.world_size // axes.sp)  # data-parallel ranks (DeepSpeed's rule)
    if parsed.seed is not None:
        torch.manual_seed(parsed.seed)
    weights = fp8_weights(model)  # before the engine shards them
    engine = Engine(model, parsed, world, model_parameters, optimizer, lr_scheduler, axes=axes) if worlds is None \
        else tensor_parallel_engine(model, parsed, worlds, model_parameters, optimizer, lr_scheduler, split)
    gather_fp8_weights(engine.storage, weights, parsed.fp8)
    if split is not None:
        engine.hold_hook(batch_check)
    loader = None
    if training_data is not None:
        loader = build_loader(training_data, engine.train_micro_batch_size_per_gpu(), _data_axis(world, axes),
                              collate_fn, seed=parsed.seed or 0, drop_last=parsed.dataloader_drop_last)
        engine.data_loader = loader
    resume_dir = _resume_dir(resume_from, parsed)
    if resume_dir is not None and (_own_checkpoints(engine, resume_dir) / LATEST).is_file():
        path, _ = engine.load_checkpoint(resume_dir, load_rng_state=True)
        log_rank(f"resumed from {path} at step {engine.global_steps}")
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _initialize_pipeline(model: "PipelineModule", config: ZeroshardConfig, model_parameters: Any, optimizer: Any,
                         lr_scheduler: SchedulerSpec, training_data: Optional[Dataset],
                         collate_fn: Optional[Callable[..., Any]], resume_from: Union[str, Path, None],
                         ) -> tuple[Engine, torch.optim.Optimizer, Optional[DistributedLoader], Any]:
    """A :class:`PipelineEngine` for a :class:`PipelineModule` (docs/PIPELINE.md); the loader, if any, is
    over the stage's data-parallel ranks (every stage of a pipeline sees the same samples).
    ``resume_from`` / ``checkpoint.auto_resume``: as without a pipeline, the ``latest`` checkpoint of the
    whole pipeline (pipeline/checkpoint.py), RNG and loader position included, once the loader is attached;
    training starts fresh when there is none yet."""
    resume_dir = _resume_dir(resume_from, config)  # a missing save_dir is named before anything is built
    if config.sequence_parallel_size > 1:
        raise SequenceParallelError(f"sequence_parallel_size = {config.sequence_parallel_size} with a PipelineModule "
                                    f"(pipeline parallelism) is not supported yet")
    if config.seed is not None:
        torch.manual_seed(config.seed)
    # the topology's axes with the stages' expert axis; the pipeline refuses MiCS and hpZ (pipeline/checks.py)
    axes = dataclasses.replace(model.groups.dims, ep=expert_parallel_size(model))
    weights = fp8_weights(model)  # before the engine shards them
    engine = PipelineEngine(model, config, model_parameters, optimizer, lr_scheduler, axes=axes)
    gather_fp8_weights(engine.storage, weights, config.fp8)
    loader = None
    if training_data is not None:
        loader = build_loader(training_data, engine.train_micro_batch_size_per_gpu(), engine.world, collate_fn,
                              seed=config.seed or 0, drop_last=config.dataloader_drop_last)
        engine.data_loader = loader
    # one checkpoint of the whole job: its ``latest`` is the directory's own (no rank's part of it, as with mpu)
    if resume_dir is not None and (resume_dir / LATEST).is_file():
        path, _ = engine.load_checkpoint(resume_dir, load_rng_state=True)
        log_rank(f"resumed from {path} at step {engine.global_steps}")
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _job_axes(config: ZeroshardConfig, world: World, tensor_parallel: int, model: nn.Module,
              model_parallel: bool = False) -> ParallelDims:
    """Every parallel axis of a job without a pipeline (distributed/parallel_dims.py), built once and
    validated here: ``world`` (the whole job) cut into ``tensor_parallel`` ranks per data-parallel rank,
    the config's sequence-parallel, MiCS and hpZ sizes and the expert axis of ``model``'s MoE layers; a
    size that does not divide what it cuts, or a sequence axis beside an axis it does not combine with
    (``model_parallel``: an mpu's), is refused by name, the same on every rank."""
    zero = config.zero_optimization
    axes = ParallelDims.for_job(world.world_size, tp=tensor_parallel, sp=config.sequence_parallel_size,
                                mics_shard_size=zero.mics_shard_size, hpz_partition_size=zero.zero_hpz_partition_size,
                                ep=expert_parallel_size(model))
    check_sequence_axes(axes, model_parallel=model_parallel)
    return axes


def _tensor_parallel_degree(config: ZeroshardConfig, model: nn.Module, mpu: Any) -> int:
    """How many ranks split each layer: the mpu's, the config's AutoTP or ``tp_model_init()``'s."""
    if mpu is not None and not isinstance(model, PipelineModule):
        return int(getattr(mpu, check_mpu(mpu)[1])())
    if isinstance(model, PipelineModule):
        return max(model.groups.dims.tp, tensor_parallel_size(model, config.tensor_parallel))
    return tensor_parallel_size(model, config.tensor_parallel)


def _sequence_degree_of(unit: Any, config: ZeroshardConfig) -> ZeroshardConfig:
    """The config with the sequence degree of ``initialize(mpu=unit)``'s sequence-parallel unit (the Hugging
    Face path's, which Accelerate passes without ``sequence_parallel_size`` in the config); a config that
    says another degree is refused."""
    size = int(unit.get_sequence_parallel_world_size())
    if config.sequence_parallel_size not in (1, size):
        raise SequenceParallelError(f"initialize(mpu=...): the sequence-parallel unit splits sequences over {size} "
                                    f"ranks but the config says sequence_parallel_size = "
                                    f"{config.sequence_parallel_size}")
    return dataclasses.replace(config, sequence_parallel_size=size)


def _check_unit_layout(unit: Any, axes: ParallelDims, world: World) -> None:
    """The unit's sequence group must hold the ranks of the engine's (consecutive ranks, [Note: the order of
    the axes] in distributed/parallel_dims.py): the attention exchanges over the one, ZeRO over the other."""
    ranks = list(dist.get_process_group_ranks(unit.get_sequence_parallel_group()))
    expected = next(list(group) for group in axes.groups("sequence") if world.rank in group)
    if ranks != expected:
        raise SequenceParallelError(f"initialize(mpu=...): the unit's sequence-parallel group holds ranks {ranks}; "
                                    f"zeroshard's sequence groups are consecutive ranks ({expected} for rank "
                                    f"{world.rank})")


def _data_axis(world: World, axes: ParallelDims) -> World:
    """The loader's world: one replica per data-parallel index, the ranks of a sequence group alike (each
    takes its slice of the same samples)."""
    if axes.sp == 1:
        return world
    return dataclasses.replace(world, rank=axes.coords(world.rank).data, world_size=axes.dp)


def _own_checkpoints(engine: Engine, directory: Path) -> Path:
    """Where this rank's checkpoints are in ``directory``: a tensor-parallel rank's part of it."""
    return Path(engine.model_slice.own_directory(directory))


def _issuing_collectives_at_one(world: World) -> World:
    """``collectives_in_a_world_of_one``: needs a process group to issue them on."""
    if world.backend == "none":
        raise ConfigError("'collectives_in_a_world_of_one' needs a process group: launch with torchrun "
                          "(--nproc-per-node 1) or call torch.distributed.init_process_group first")
    return dataclasses.replace(world, collectives_at_one=True)


def _resume_dir(resume_from: Union[str, Path, None], config: ZeroshardConfig) -> Optional[Path]:
    """The directory to resume from: ``resume_from``, or the config's ``checkpoint.save_dir``."""
    if resume_from is None and not config.checkpoint.auto_resume:
        return None
    if resume_from is None or str(resume_from) == "latest":
        if config.checkpoint.save_dir is None:
            raise ValueError("initialize(resume_from=\"latest\") needs the config key 'checkpoint.save_dir' (the "
                             "directory the checkpoints are saved to), or pass that directory as resume_from=")
        return Path(config.checkpoint.save_dir)
    return Path(resume_from)


def _config_source(config: Any, config_params: Any, args: Any) -> Any:
    """Where the config comes from: ``config``, else ``config_params``, else ``args.deepspeed_config``
    (DeepSpeed refuses two sources at once, and so does zeroshard)."""
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None) \
            or getattr(args, "zeroshard_config", None)
    given = [s for s in (config, config_params) if s is not None]
    if len(given) == 2:
        raise ValueError("initialize() got both config= and config_params=; pass one")
    if given and from_args is not None:
        raise ValueError(f"initialize() got a config and also args.deepspeed_config={from_args!r}; pass one "
                         f"(drop --deepspeed_config, or the config= argument)")
    return given[0] if given else from_args
