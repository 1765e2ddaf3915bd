"""The engine's checkpoints and full weights: save, load, periodic saves, 16-bit export, full state dict.

:class:`EngineCheckpointer` is a part the engine owns.  It is built with what it hands to
``zeroshard/checkpoint`` (the stateful parts of the training state, :class:`TrainingParts`), the world
it saves in, and what the config decided (:class:`CheckpointSettings`); what it needs from the engine
at the moment of a save or load comes through two callables, so it never sees the engine itself.  How
a checkpoint is written, published and resharded lives in ``zeroshard/checkpoint``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import nn

from ..checkpoint import load_checkpoint
from ..checkpoint.background import BackgroundSaves
from ..checkpoint.deepspeed_format.engine_save import STAGING_DIR, save_in_deepspeed_layout
from ..checkpoint.format import FileWriting, checked_directory, write_state_dict
from ..checkpoint.interface import CheckpointParts
from ..checkpoint.rotation import prune
from ..checkpoint.save import capture, write
from ..distributed.consistency import Call
from ..logging import log_rank
from ..checkpoint.module_state import ModuleState
from ..optim.sharded_state import OptimizerHyperparameters, ShardedState
from ..checkpoint.rng import RNGState
from ..experts.checkpoint import ExpertPlacement, expert_parts
from ..sharding.storage import HOMES

if TYPE_CHECKING:  # only for the types below; the engine imports this module, not the reverse
    from ..config import ZeroshardConfig
    from ..config.schema import CheckpointConfig
    from .counters import TrainingCounters
    from ..distributed.collectives import Collectives
    from ..distributed.consistency import ConsistencyCheck
    from ..distributed.world import World
    from ..offload.policy import OffloadPolicies
    from ..optim.updater import ShardUpdater
    from ..precision import LossScaler, PrecisionPolicy
    from ..sharding import ShardingStrategy
    from ..sharding.strategy import StageTraits


@dataclass(frozen=True)
class TrainingParts:
    """The engine's parts that a checkpoint saves and restores, fixed for the engine's life."""

    module: nn.Module
    param_names: list[str]
    strategy: "ShardingStrategy"
    updater: "ShardUpdater"
    optimizer: torch.optim.Optimizer
    loss_scaler: "LossScaler"
    counters: "TrainingCounters"
    #: expert parallelism: which experts this rank holds (see [Note: experts in a checkpoint] in
    #: experts/checkpoint.py)
    experts: Optional[ExpertPlacement] = None
    #: where this rank's model is part of the whole (experts spread over ranks, layers split over a
    #: tensor-parallel group): this rank's full state dict -> the whole model's; every rank calls it,
    #: the second argument says whether this rank keeps the result
    whole_model: Optional[Callable[[dict[str, torch.Tensor], bool], dict[str, torch.Tensor]]] = None
    #: where zeroshard split the model over a tensor-parallel group: ``CheckpointParts.tensor_slice``
    tensor_slice: Optional[tuple[int, int, dict[str, int]]] = None


@dataclass(frozen=True)
class Attached:
    """What a caller may attach to the engine after it is built (``initialize(training_data=...)`` sets
    the data loader), read when a checkpoint is taken."""

    lr_scheduler: Any
    data_loader: Any


@dataclass(frozen=True)
class CheckpointSettings:
    """What the config decides about checkpoints, decided once."""

    #: the ``checkpoint`` block: periodic saves, node-local storage, the writer
    checkpoint: "CheckpointConfig"
    #: whether ``save_16bit_model`` gathers full weights (always below stage 3)
    gathers_16bit_weights: bool
    #: ``save_16bit_model``'s dtype when the caller names none: the training dtype under mixed precision
    weights_dtype: torch.dtype
    #: an asynchronous save copies the state on its own thread (not with NVMe swap files, which one
    #: thread at a time reads)
    copy_later: bool

    #: whether the engine's optimizer steps make the config's periodic saves (a pipeline stage's do
    #: not: the whole pipeline saves after its batch)
    saves_periodically: bool = True
    #: what a save in DeepSpeed's layout names as its config (its stage, precision, batch, clipping)
    deepspeed_config: Optional[dict[str, Any]] = None

    @staticmethod
    def from_config(config: "ZeroshardConfig", traits: "StageTraits", precision: "PrecisionPolicy",
                    offload: "OffloadPolicies", saves_periodically: bool = True) -> "CheckpointSettings":
        return CheckpointSettings(
            config.checkpoint,
            not traits.shards_parameters or config.zero_optimization.stage3_gather_16bit_weights_on_model_save,
            precision.compute if precision.mixed else torch.bfloat16,
            not offload.uses_nvme, saves_periodically,
            {"train_micro_batch_size_per_gpu": config.train_micro_batch_size_per_gpu,
             "gradient_accumulation_steps": config.gradient_accumulation_steps,
             "gradient_clipping": config.gradient_clipping, "zero_optimization": {"stage": traits.stage},
             "bf16": {"enabled": config.bf16.enabled}, "fp16": {"enabled": config.fp16.enabled}})


class EngineCheckpointer:
    """Saves, loads and exports the engine's training state (the engine's checkpoint methods call it).

    ``attached`` gives the LR schedule and data loader the engine has now; ``resume_at_boundary`` is
    what the engine does after a load (see ``Engine._resume_at_boundary``).
    """

    def __init__(self, parts: TrainingParts, world: "World", comm: "Collectives", agree: "ConsistencyCheck",
                 saves: BackgroundSaves, settings: CheckpointSettings, attached: Callable[[], Attached],
                 resume_at_boundary: Callable[[], None]) -> None:
        self.parts = parts
        self.world = world
        self.comm = comm
        self.agree = agree
        self.saves = saves
        self.settings = settings
        self.attached = attached
        self.resume_at_boundary = resume_at_boundary

    def _agree_on(self, call: Call, detail: Optional[str]) -> None:
        """Every rank makes this call at the same step, or every rank raises."""
        counters = self.parts.counters
        self.agree.agree(call, counters.micro_steps, counters.global_steps, detail)

    # ------------------------------------------------------------------ checkpoints
    def save(self, save_dir: Union[str, Path], tag: Any, client_state: Any, save_latest: bool,
             exclude_frozen: bool, async_save: Optional[bool], then: Optional[Callable[[], None]] = None,
             layout: Optional[str] = None) -> Path:
        """``Engine.save_checkpoint``; ``then`` runs once the checkpoint is published; ``layout``:
        ``checkpoint.format`` for this save."""
        save_dir = checked_directory(save_dir, "save_checkpoint", "save_dir")
        if (layout or self.settings.checkpoint.format) == "deepspeed":
            return self._save_deepspeed(save_dir, tag, client_state, save_latest, exclude_frozen, async_save)
        if layout not in (None, "zeroshard"):
            raise ValueError(f"save_checkpoint: format {layout!r}: 'zeroshard' or 'deepspeed'")
        writer = self.settings.checkpoint.writer
        background = writer.decoupled if async_save is None else bool(async_save)
        self.saves.wait()  # the previous asynchronous save is published (or its error raised) first
        tag_name = f"global_step{self.parts.counters.global_steps}" if tag is None else str(tag)
        how = "in the background" if background else "synchronously"
        if self.settings.checkpoint.tag_validation == "Fail":
            self._agree_on(Call.SAVE, f"{tag_name} ({how})")
        else:
            self._agree_on(Call.SAVE, how)
            tag_name = self._common_tag(tag_name)
        request = capture(self.checkpoint_parts(), save_dir, tag_name, client_state, save_latest,
                          node_local=self.settings.checkpoint.use_node_local_storage, exclude_frozen=exclude_frozen,
                          buffers=self.saves.buffers if background else None,
                          writing=FileWriting(writer.io_buffer_size, direct=writer.type == "fast"),
                          copy_later=self.settings.copy_later)
        if background:
            self.saves.submit(request, then, spread_over_steps=writer.spread_over_steps)
            return request.final
        write(request, self.comm)
        if then is not None:
            then()
        return request.final

    def _save_deepspeed(self, save_dir: Path, tag: Any, client_state: Any, save_latest: bool, exclude_frozen: bool,
                        async_save: Optional[bool]) -> Path:
        """A save in DeepSpeed's layout (see [Note: a save in DeepSpeed's layout] in
        checkpoint/deepspeed_format/engine_save.py)."""
        if async_save:
            raise ValueError("save_checkpoint: a save in DeepSpeed's layout is written synchronously "
                             "(async_save=True is zeroshard's own layout only)")
        parts = self.parts
        if parts.experts is not None or parts.tensor_slice is not None or parts.whole_model is not None \
                or self.settings.checkpoint.use_node_local_storage or exclude_frozen:
            raise ValueError("save_checkpoint: DeepSpeed's layout is written for one data-parallel group (no tensor, "
                             "pipeline or expert parallelism), on a shared file system, frozen parameters included")
        staging = save_dir / STAGING_DIR
        saved = self.save(staging, tag, client_state, False, False, False, layout="zeroshard")
        return save_in_deepspeed_layout(saved, save_dir, save_latest, self.world.world_size,
                                        dict(self.settings.deepspeed_config or {}), self.world.is_main,
                                        lambda error: self.comm.all_gather_json(error, "deepspeed_layout"))

    def _common_tag(self, tag_name: str) -> str:
        """``checkpoint.tag_validation`` Warn / Ignore: every rank saves under rank 0's tag, so that the
        ranks' files make one checkpoint; Warn says so on every rank when the tags differ."""
        if not self.world.is_distributed:
            return tag_name
        tags = self.comm.all_gather_json(tag_name, "checkpoint_tag")
        if len(set(tags)) > 1 and self.settings.checkpoint.tag_validation == "Warn":
            logging.getLogger("zeroshard").warning(
                "save_checkpoint: the ranks passed different tags (%s); every rank saves under rank 0's %r "
                "(checkpoint.tag_validation \"Warn\"; \"Fail\" makes this an error)",
                ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags)), tags[0])
        return str(tags[0])

    def save_periodically(self) -> None:
        """``checkpoint.save_interval``: every rank saves at the same step, then rank 0 prunes once the
        save is published (see [Note: pruning never loses the checkpoint to resume from] in
        checkpoint/rotation.py)."""
        ckpt = self.settings.checkpoint
        if self.settings.saves_periodically and ckpt.save_dir and ckpt.save_interval \
                and self.parts.counters.global_steps % ckpt.save_interval == 0:
            publisher = self.world.local_rank == 0 if ckpt.use_node_local_storage else self.world.is_main
            root, keep = Path(ckpt.save_dir), ckpt.keep_last

            def prune_old() -> None:
                prune(root, keep)

            self.save(root, None, None, True, False, None, then=prune_old if keep and publisher else None)

    def load(self, load_dir: Union[str, Path], tag: Any, load_module_strict: bool, load_optimizer_states: bool,
             load_lr_scheduler_states: bool, load_module_only: bool, load_rng_state: Optional[bool],
             ) -> tuple[Optional[Path], Any]:
        """``Engine.load_checkpoint``.

        [Note: who owns the random number generators on resume]
        ``load_rng_state=None`` (the default) restores torch's RNG states from the checkpoint only
        when this engine owns the data pipeline (``initialize(training_data=...)``): then resume is
        bitwise, data order included.  A script with its own loader keeps its own seeding, as under
        DeepSpeed, whose ``load_checkpoint`` never touches the global generators: a DeepSpeed script
        therefore resumes with the data order it had there.  ``True``/``False`` decide explicitly.
        """
        load_dir = checked_directory(load_dir, "load_checkpoint", "load_dir")
        restore_rng = self.attached().data_loader is not None if load_rng_state is None else load_rng_state
        self.saves.wait()  # a load reads what is published: an asynchronous save in flight finishes first
        self._agree_on(Call.LOAD, None if tag is None else str(tag))
        loaded = load_checkpoint(self.checkpoint_parts(), load_dir, None if tag is None else str(tag),
                                 load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                                 load_module_only, restore_rng)
        self.resume_at_boundary()
        return loaded

    def checkpoint_parts(self) -> CheckpointParts:
        """The engine's stateful parts, as a checkpoint saves and restores them (checkpoint/interface.py)."""
        parts, attached = self.parts, self.attached()
        strategy, storage = parts.strategy, parts.strategy.storage
        loader = attached.data_loader if hasattr(attached.data_loader, "state_dict") else None
        strategy.wait_for_buckets(None)  # a save reads, a load writes the parameters: no gather in flight
        storage.take_back_chunks()  # ... and each chunk is in its store
        checkpoint = CheckpointParts(
            self.world, self.comm, strategy.stage, ShardedState(parts.updater, strategy),
            ModuleState(parts.module, strategy.params, parts.param_names, storage),
            OptimizerHyperparameters(parts.optimizer), parts.counters, parts.loss_scaler, RNGState(),
            lambda identity: self._agree_on(Call.LOAD, identity), attached.lr_scheduler, loader,
            tensor_slice=parts.tensor_slice)
        return checkpoint if parts.experts is None else expert_parts(checkpoint, parts.experts, parts.param_names)

    # ------------------------------------------------------------------ full weights
    def save_16bit_model(self, save_dir: Union[str, Path], save_filename: str, dtype: Optional[torch.dtype],
                         exclude_frozen_parameters: bool) -> Optional[Path]:
        """``Engine.save_16bit_model``: rank 0 writes, every rank gathers."""
        if not self.settings.gathers_16bit_weights:
            log_rank("save_16bit_model: nothing written: at stage 3 it needs zero_optimization."
                     "stage3_gather_16bit_weights_on_model_save = true (or use save_checkpoint + "
                     "zeroshard consolidate)", level=logging.WARNING)
            return None
        state = self.full_state_dict(rank0_only=True)
        if not self.world.is_main:
            return None
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.parts.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        target = Path(save_dir) / save_filename
        target.parent.mkdir(parents=True, exist_ok=True)
        write_state_dict(target, state, dtype or self.settings.weights_dtype)
        return target

    def full_state_dict(self, rank0_only: bool) -> dict[str, torch.Tensor]:
        """``Engine.full_state_dict``: gathered one bucket at a time, every rank calling."""
        keep = self.world.rank == 0 or not rank0_only
        whole = self.parts.whole_model
        if whole is not None:  # every rank's part of the model (experts, tensor-parallel shards) gathered
            return whole(self._full_state_dict(True), keep)
        return self._full_state_dict(keep)

    def _full_state_dict(self, keep: bool) -> dict[str, torch.Tensor]:
        self.parts.strategy.wait_for_buckets(None)
        values: dict[int, torch.Tensor] = {}
        storage = self.parts.strategy.storage
        for bucket in storage.layout.buckets:
            storage.gather(bucket.index, f"full_state_dict{bucket.index}")
            if keep:
                for slot in bucket.slots:
                    values[slot.index] = storage.full[bucket.index][slot.offset: slot.offset + slot.numel] \
                        .view(slot.shape).detach().to("cpu", copy=True)
            storage.release(bucket.index)
        if not keep:
            return {}
        index_of = {id(p): i for i, p in enumerate(storage.params)}
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.parts.module.state_dict(keep_vars=True).items():
            home = HOMES.home_of(tensor)
            i = index_of.get(id(tensor))
            if i is None and home is not None:  # a released stage-3 parameter's placeholder
                i = next(s.index for s in storage.layout.buckets[home.bucket].slots if s.name == home.name)
            out[name] = values[i] if i is not None else tensor.detach().to("cpu", copy=True)
        return out
