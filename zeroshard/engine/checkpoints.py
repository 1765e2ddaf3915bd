"""The engine's checkpoints and full weights: save, load, periodic saves, 16-bit export, full state dict.

A mixin of :class:`~zeroshard.engine.engine.Engine` (as :mod:`zeroshard.deepspeed.engine_api` is), so that the
engine module holds what training does and this one what the engine hands to ``zeroshard/checkpoint``:
the stateful parts of the training state (:meth:`EngineCheckpoints.checkpoint_parts`) and when to save
them.  How a checkpoint is written, published and resharded lives in ``zeroshard/checkpoint``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import nn

from ..checkpoint import load_checkpoint
from ..checkpoint.background import BackgroundSaves
from ..checkpoint.format import FileWriting, write_state_dict
from ..checkpoint.interface import CheckpointParts
from ..checkpoint.rotation import prune
from ..checkpoint.save import capture, write
from ..distributed.consistency import Call
from ..logging import log_rank
from ..checkpoint.module_state import ModuleState
from ..optim.sharded_state import OptimizerHyperparameters, ShardedState
from ..checkpoint.rng import RNGState
from ..sharding.storage import HOMES

if TYPE_CHECKING:  # only for the attribute types below; the engine imports this module, not the reverse
    from ..config import ZeroshardConfig
    from .counters import TrainingCounters
    from ..distributed.collectives import Collectives
    from ..distributed.consistency import ConsistencyCheck
    from ..distributed.world import World
    from ..offload.policy import OffloadPolicies
    from ..optim.updater import ShardUpdater
    from ..precision import LossScaler, PrecisionPolicy
    from ..sharding import ShardingStrategy
    from ..sharding.storage import ParameterStorage


class EngineCheckpoints:
    """Checkpoints and full weights of the engine (mixed into :class:`Engine`)."""

    module: nn.Module
    config: "ZeroshardConfig"
    world: "World"
    comm: "Collectives"
    saves: BackgroundSaves
    offload: "OffloadPolicies"
    strategy: "ShardingStrategy"
    updater: "ShardUpdater"
    optimizer: torch.optim.Optimizer
    precision: "PrecisionPolicy"
    counters: "TrainingCounters"
    loss_scaler: "LossScaler"
    lr_scheduler: Any
    data_loader: Any
    param_names: list[str]
    flat: "ParameterStorage"
    _agree: "ConsistencyCheck"
    global_steps: int
    micro_steps: int
    _backwards_since_step: int
    _boundary_backward_done: bool
    _nonfinite_loss_seen: bool
    gradient_accumulation_steps: Callable[[], int]
    zero_grad: Callable[[], None]

    # ------------------------------------------------------------------ checkpoints
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
        return self._save(save_dir, tag, client_state, save_latest, exclude_frozen_parameters, async_save)

    def _save(self, save_dir: Union[str, Path], tag: Any, client_state: Any, save_latest: bool,
              exclude_frozen: bool, async_save: Optional[bool], then: Optional[Callable[[], None]] = None) -> Path:
        writer = self.config.checkpoint.writer
        background = writer.decoupled if async_save is None else bool(async_save)
        self.saves.wait()  # the previous asynchronous save is published (or its error raised) first
        tag_name = f"global_step{self.global_steps}" if tag is None else str(tag)
        self._agree.agree(Call.SAVE, self.micro_steps, self.global_steps,
                          f"{tag_name} ({'in the background' if background else 'synchronously'})")
        request = capture(self.checkpoint_parts(), save_dir, tag_name, client_state, save_latest,
                          node_local=self.config.checkpoint.use_node_local_storage, exclude_frozen=exclude_frozen,
                          buffers=self.saves.buffers if background else None,
                          writing=FileWriting(writer.io_buffer_size, direct=writer.type == "fast"),
                          copy_later=not self.offload.uses_nvme)  # swap files: read by one thread at a time
        if background:
            self.saves.submit(request, then, spread_over_steps=writer.spread_over_steps)
            return request.final
        write(request, self.comm)
        if then is not None:
            then()
        return request.final

    def wait_for_checkpoint(self) -> Optional[Path]:
        """Block until the asynchronous save in flight is published; returns its directory (None when
        none was in flight).  Raises its error, on every rank, if it failed."""
        return self.saves.wait()

    def _save_periodically(self) -> None:
        """``checkpoint.save_interval``: every rank saves at the same step, then rank 0 prunes once the
        save is published (see [Note: pruning never loses the checkpoint to resume from])."""
        ckpt = self.config.checkpoint
        if ckpt.save_dir and ckpt.save_interval and self.global_steps % ckpt.save_interval == 0:
            publisher = self.world.local_rank == 0 if ckpt.use_node_local_storage else self.world.is_main
            root, keep = Path(ckpt.save_dir), ckpt.keep_last

            def prune_old() -> None:
                prune(root, keep)

            self._save(root, None, None, True, False, None, then=prune_old if keep and publisher else None)

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
        restore_rng = self.data_loader is not None if load_rng_state is None else load_rng_state
        self.saves.wait()  # a load reads what is published: an asynchronous save in flight finishes first
        self._agree.agree(Call.LOAD, self.micro_steps, self.global_steps, None if tag is None else str(tag))
        loaded = load_checkpoint(self.checkpoint_parts(), load_dir, None if tag is None else str(tag),
                                 load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                                 load_module_only, restore_rng)
        self._resume_at_boundary()
        return loaded

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
        self._nonfinite_loss_seen = False

    def checkpoint_parts(self) -> CheckpointParts:
        """The engine's stateful parts, as a checkpoint saves and restores them (checkpoint/interface.py)."""
        loader = self.data_loader if hasattr(self.data_loader, "state_dict") else None
        self.strategy.wait_for_buckets(None)  # a save reads, a load writes the parameters: no gather in flight
        self.flat.take_back_chunks()  # ... and each chunk is in its store
        return CheckpointParts(
            self.world, self.comm, self.strategy.stage, ShardedState(self.updater, self.strategy),
            ModuleState(self.module, self.strategy.params, self.param_names, self.flat), OptimizerHyperparameters(self.optimizer),
            self.counters, self.loss_scaler, RNGState(),
            lambda identity: self._agree.agree(Call.LOAD, self.micro_steps, self.global_steps, identity),
            self.lr_scheduler, loader)

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
        if not self.zero_gather_16bit_weights_on_model_save():
            log_rank("save_16bit_model: nothing written: at stage 3 it needs zero_optimization."
                     "stage3_gather_16bit_weights_on_model_save = true (or use save_checkpoint + "
                     "zeroshard consolidate)", level=logging.WARNING)
            return None
        dtype = dtype or (self.precision.compute if self.precision.mixed else torch.bfloat16)
        state = self.full_state_dict(rank0_only=True)
        if not self.world.is_main:
            return None
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        target = Path(save_dir) / save_filename
        target.parent.mkdir(parents=True, exist_ok=True)
        write_state_dict(target, state, dtype)
        return target

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether ``save_16bit_model`` gathers full weights (always below stage 3; the config's
        ``stage3_gather_16bit_weights_on_model_save`` at stage 3)."""
        return self.strategy.stage < 3 or self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save


    # ------------------------------------------------------------------ full weights
    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The model's ordinary state dict with full values, as CPU tensors.

        Gathers one bucket at a time (peak: one bucket beyond the shards).  Every rank must call it;
        with ``rank0_only`` the other ranks get an empty dict.  Tied weights appear under each of
        their names, as ``nn.Module.state_dict`` gives them, so ``load_state_dict(strict=True)`` works.
        """
        keep = self.world.rank == 0 or not rank0_only
        self.strategy.wait_for_buckets(None)
        values: dict[int, torch.Tensor] = {}
        storage = self.flat
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
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            home = HOMES.home_of(tensor)
            i = index_of.get(id(tensor))
            if i is None and home is not None:  # a released stage-3 parameter's placeholder
                i = next(s.index for s in storage.layout.buckets[home.bucket].slots if s.name == home.name)
            out[name] = values[i] if i is not None else tensor.detach().to("cpu", copy=True)
        return out

