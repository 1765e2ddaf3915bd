"""Checkpoints of a pipelined model: one checkpoint of the whole job, keyed by the layers' global names.

[Note: a pipeline checkpoint loads at any split]
Each stage's engine saves its shard of its own layers' parameters and optimizer state, under the names
the layers have in one ``nn.Sequential`` of every layer (``<global layer index>.<parameter>``, a tied
weight once, under its owner's first layer; ``PipelineModule.global_name``), into one checkpoint with
one manifest ([Note: a checkpoint of a job in parts] in checkpoint/job.py).  Nothing in it depends on
the split: a load at another pipeline depth, data-parallel degree or ZeRO stage reads, by name, the
layers its stage holds now, and ``zeroshard consolidate`` gives the weights of that ``nn.Sequential``.
After a load each tied copy is refreshed from its owner, as after every step.

[Note: a pipeline of tensor-parallel stages in a checkpoint]
With tensor parallelism each tensor index's ranks (one per stage and data-parallel index) save their
part of the job as one pipeline checkpoint, in ``mp_rank_XX`` of the directory, and ``tensor_split.json``
beside the parts records along which dimension each split parameter (by its job name) is cut, as a
tensor-parallel model's checkpoint does ([Note: a tensor-parallel checkpoint read at another size] in
checkpoint/tensor_parts.py).  A load reads the parts joined and cut again at its own tensor-parallel
size, by name: the same checkpoint loads at another pipeline depth, tensor or data-parallel degree, ZeRO
stage, or into a plain model.  The ranks of the whole job agree that the load succeeded: each tensor
index reads on its own, and a failure on one must stop every other rank, whose next forward would
wait for it in a tensor-parallel collective.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from ..checkpoint.format import CheckpointError, FileWriting, checked_directory
from ..checkpoint.interface import CheckpointParts, PartOfJob
from ..checkpoint.job import JobNamedModule, JobNamedShards
from ..checkpoint.load import load_checkpoint
from ..checkpoint.rotation import prune
from ..checkpoint.save import save_checkpoint
from ..config.schema import CheckpointConfig
from ..distributed.collectives import Collectives
from .module import PipelineModule


def job_parts(parts: CheckpointParts, module: PipelineModule, param_names: Sequence[str],
              job_comm: Collectives) -> CheckpointParts:
    """A stage engine's ``parts`` under the job's names, over the ranks of the job that save one
    checkpoint together (``job_comm``: every rank, or with tensor parallelism those of one tensor index,
    numbered ``stage * dp + data`` as without it); every rank of ``job_comm`` calls it."""
    groups = module.groups
    names = [module.global_name(n) for n in param_names]
    plans = job_comm.all_gather_json(
        {"stage": groups.stage, "buckets": len(parts.shards.layout.buckets), "names": names},
        "pipeline_checkpoint_plan")
    buckets_of = {plan["stage"]: plan["buckets"] for plan in plans}
    base = sum(buckets_of[stage] for stage in range(groups.stage))
    job = PartOfJob(groups.stage, groups.dims.pp, groups.stage * groups.dims.dp, groups.data == 0,
                    frozenset(name for plan in plans for name in plan["names"]))
    return dataclasses.replace(parts, world=job_comm.world, comm=job_comm,
                               shards=JobNamedShards(parts.shards, module.global_name, base),
                               module=JobNamedModule(parts.module, module.global_name), job=job)


def save_pipeline(parts: CheckpointParts, settings: CheckpointConfig, save_dir: Union[str, Path], tag_name: str,
                  client_state: Any, save_latest: bool, exclude_frozen: bool) -> Path:
    """``save_checkpoint`` of a pipeline engine (``parts``: :func:`job_parts`): every rank of the job
    writes, rank 0 publishes, under rank 0's tag."""
    save_dir = checked_directory(save_dir, "save_checkpoint", "save_dir")
    tags = parts.comm.all_gather_json(tag_name, "checkpoint_tag")
    if len(set(tags)) > 1 and settings.tag_validation == "Fail":
        raise CheckpointError(f"save_checkpoint: the ranks passed different tags ({sorted(set(tags))}); "
                              f"nothing was saved (checkpoint.tag_validation \"Fail\")")
    writer = settings.writer
    return save_checkpoint(parts, save_dir, str(tags[0]), client_state, save_latest, exclude_frozen=exclude_frozen,
                           writing=FileWriting(writer.io_buffer_size, direct=writer.type == "fast"))


def load_pipeline(parts: CheckpointParts, load_dir: Union[str, Path], tag: Any, strict: bool,
                  load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool,
                  restore_rng: bool) -> tuple[Optional[Path], Any]:
    """``load_checkpoint`` of a pipeline engine (``parts``: :func:`job_parts`), from a checkpoint saved
    at any split (see the Note); the engine then refreshes its tied copies."""
    load_dir = checked_directory(load_dir, "load_checkpoint", "load_dir")
    return load_checkpoint(parts, load_dir, None if tag is None else str(tag), strict, load_optimizer_states,
                           load_lr_scheduler_states, load_module_only, restore_rng)


def periodic_save_due(settings: CheckpointConfig, global_steps: int) -> bool:
    """Whether ``checkpoint.save_interval`` asks for a save after optimizer step ``global_steps``."""
    return bool(settings.save_dir and settings.save_interval and global_steps % settings.save_interval == 0)


def prune_periodic(settings: CheckpointConfig, directory: Path, publisher: bool) -> None:
    """After a periodic save is published in ``directory`` (``save_dir``, or a tensor-parallel part of
    it): its publisher keeps the newest ``checkpoint.keep_last`` (see [Note: pruning never loses the
    checkpoint to resume from] in checkpoint/rotation.py)."""
    if settings.keep_last and publisher:
        prune(directory, settings.keep_last)
