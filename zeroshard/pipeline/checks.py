"""What a pipelined run refuses before any engine is built, the same on every rank (so every rank
raises it, and none waits in a collective for a rank that stopped)."""

from __future__ import annotations

from ..config import ZeroshardConfig, resolve_batch_sizes
from ..config.errors import ConfigError
from .module import PipelineModule
from .schedule import SCHEDULES, ScheduleShapeError


class PipelineConfigError(ConfigError):
    """A config key that pipelining does not support yet, or that disagrees with the ``PipelineModule``."""


class PipelineBatchSizeError(ConfigError):
    """``train_batch_size`` is not micro batch x accumulation steps x data-parallel size."""


def resolve_pipeline_batch_sizes(config: ZeroshardConfig, data_parallel_size: int) -> ZeroshardConfig:
    """The batch keys over the data-parallel ranks of a stage (the stages share each sample)."""
    try:
        return resolve_batch_sizes(config, data_parallel_size)
    except ConfigError as error:
        raise PipelineBatchSizeError(
            f"{error} -- with pipelining, world_size here is the data-parallel size {data_parallel_size} "
            f"(the ranks / pipeline stages): train_batch_size = train_micro_batch_size_per_gpu x "
            f"gradient_accumulation_steps x data-parallel size") from None


def check_pipeline_config(config: ZeroshardConfig, module: PipelineModule) -> None:
    """Refuse what this pipeline engine does not do, and keys that disagree with the module."""
    block = config.pipeline
    module_values = {"stages": module.num_stages, "partition": module.partition_method,
                     "seed_layers": module.seed_layers,
                     "activation_checkpoint_interval": module.activation_checkpoint_interval,
                     "virtual_stages": module.virtual_stages}
    for name, value in module_values.items():
        given = getattr(block, name)
        if given is not None and given != value:
            raise PipelineConfigError(f"'pipeline.{name}' = {given!r} but the PipelineModule was built with {value!r}: "
                                      f"the module's arguments decide the split; remove the key or make them agree")
    zero = config.zero_optimization
    if module.virtual_stages > 1 and block.stage3_gather_per_micro_batch and zero.stage == 3:
        # the gather scheduler prefetches the units its trace of the last pass used next; a rank's passes
        # alternate between chunks, so that trace is the wrong chunk's half the time
        raise PipelineConfigError("'pipeline.stage3_gather_per_micro_batch' is not supported with virtual stages: "
                                  "a stage's passes alternate between its chunks, which the gather scheduler's "
                                  "prefetch does not follow; keep the default (one gather per batch), or use "
                                  "one chunk per stage")
    refused = {
        # a swap failure stops the failing stage's ranks only (OptimizerStep.raise_swap_failures agrees over the
        # stage's data-parallel group), and the other stages would wait for them
        "zero_optimization.offload_optimizer.device: nvme (cpu is supported)": zero.offload_optimizer.device == "nvme",
        "zero_optimization.offload_param.device: nvme (cpu is supported)": zero.offload_param.device == "nvme",
        "zero_optimization.mics_shard_size": zero.mics_shard_size > 0,
        "zero_optimization.zero_hpz_partition_size": zero.zero_hpz_partition_size > 1,
        "checkpoint.writer.decoupled": config.checkpoint.writer.decoupled,
        "checkpoint.use_node_local_storage": config.checkpoint.use_node_local_storage,
    }
    for name, used in refused.items():
        if used:
            raise PipelineConfigError(f"'{name}' is not supported with pipeline parallelism yet (docs/PIPELINE.md, "
                                      f"\"Not yet\"): remove it, or train without a PipelineModule")


def pipeline_config(config: ZeroshardConfig, module: PipelineModule) -> ZeroshardConfig:
    """The config checked and with its batch sizes resolved over the stage's data-parallel ranks."""
    check_pipeline_config(config, module)
    resolved = resolve_pipeline_batch_sizes(config, module.groups.dims.dp)
    try:
        SCHEDULES[config.pipeline.schedule].check(module.num_stages, resolved.gradient_accumulation_steps or 1,
                                                  module.virtual_stages)
    except ScheduleShapeError as error:
        raise PipelineConfigError(str(error)) from None
    return resolved
