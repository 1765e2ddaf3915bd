"""``ZeroshardStrategy``: Lightning's Trainer drives a zeroshard engine.

[Note: what the Lightning strategy hands the engine]
Lightning owns the loop, zeroshard the model's state.  ``setup`` wraps the LightningModule in an
engine built from the strategy's config, with the keys Lightning decides filled in from the Trainer:
the stage (``zeroshard_stage_N``), ``gradient_accumulation_steps`` from ``accumulate_grad_batches``
(the engine accumulates, so Lightning calls the optimizer step at every batch and the engine steps at
the boundary), ``gradient_clipping`` from ``gradient_clip_val`` (the engine clips the global norm over
every shard; clipping by value is refused) and the precision block from ``precision``.  The optimizer
and scheduler are the module's ``configure_optimizers``; Lightning steps the scheduler, so the engine
holds none.  A checkpoint is zeroshard's own (sharded, resharding on load): ``save_checkpoint`` hands
Lightning's dictionary, without the weights and optimizer state the engine writes itself, to the
engine as client state under the tag ``checkpoint``, and a ``ckpt_path`` resume loads it back after
the engine is built.  The engine stays open after ``fit`` (its weights are sharded at stage 3): read
them with ``strategy.engine.full_state_dict()`` or ``zeroshard.GatheredParameters``.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Generator, Mapping, Optional, Union, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn
from torch.optim import Optimizer

from ..api import initialize
from ..config.loader import read_config_source
from ..engine.engine import Engine
from ..sharding.stage3.init_context import Init
from .precision import ZeroshardPrecision

__all__ = ["ZeroshardStrategy", "CHECKPOINT_TAG"]

#: the tag under which a Lightning checkpoint path holds the engine's checkpoint (DeepSpeed's layout)
CHECKPOINT_TAG = "checkpoint"


class ZeroshardStrategy(DDPStrategy):
    """ZeRO stages 1-3 under Lightning's Trainer ([Note: what the Lightning strategy hands the engine]).

    ``stage``: the ZeRO stage; ``config``: a zeroshard (DeepSpeed-style) config, a dict or a JSON path,
    for everything the Trainer does not decide.  Registered as ``zeroshard_stage_1``, ``_2``, ``_3``.
    """

    strategy_name = "zeroshard"

    def __init__(self, stage: int = 3, config: Union[str, Path, Mapping[str, Any], None] = None,
                 accelerator: Optional["pl.accelerators.Accelerator"] = None,
                 parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None,
                 precision_plugin: Optional[Precision] = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout)
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroshardStrategy(stage={stage!r}): the stage is 1, 2 or 3")
        self.user_config: dict[str, Any] = read_config_source(config) if config is not None else {}
        named = (self.user_config.get("zero_optimization") or {}).get("stage")
        if named is not None and named != stage:
            raise ValueError(f"ZeroshardStrategy(stage={stage}) with a config whose zero_optimization.stage is "
                             f"{named}: give the stage once")
        for key in ("gradient_accumulation_steps", "train_batch_size"):
            if key in self.user_config:
                raise MisconfigurationException(f"{key!r} is set in the config; Lightning decides it: set "
                                                f"Trainer(accumulate_grad_batches=...) and the loader's batch size")
        self.stage = stage
        self._engine: Optional[Engine] = None

    # ------------------------------------------------------------------ precision: always the engine's
    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else ZeroshardPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        """Lightning hands every strategy the plugin of the Trainer's ``precision`` flag; zeroshard's
        engine runs that precision itself, so the flag becomes a :class:`ZeroshardPrecision`."""
        self._precision_plugin = plugin if plugin is None or isinstance(plugin, ZeroshardPrecision) \
            else ZeroshardPrecision(str(plugin.precision))

    # ------------------------------------------------------------------ the engine
    @property
    def engine(self) -> Engine:
        """The zeroshard engine wrapping the LightningModule (built by ``setup``)."""
        if self._engine is None:
            raise RuntimeError("the zeroshard engine is built when the Trainer sets the strategy up (fit, validate, "
                               "test, predict)")
        return self._engine

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    def engine_config(self, trainer: "pl.Trainer") -> dict[str, Any]:
        """The engine's config: the strategy's, with what the Trainer decides filled in."""
        config = copy.deepcopy(self.user_config)
        config.setdefault("zero_optimization", {})["stage"] = self.stage
        config["gradient_accumulation_steps"] = trainer.accumulate_grad_batches
        config.setdefault("train_micro_batch_size_per_gpu", _micro_batch_size(trainer))
        if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE and trainer.gradient_clip_val:
            raise MisconfigurationException("zeroshard clips the global gradient norm; clipping by value is not "
                                            "supported (gradient_clip_algorithm='norm')")
        clip = float(trainer.gradient_clip_val or 0.0)
        if "gradient_clipping" in config and trainer.gradient_clip_val is not None \
                and config["gradient_clipping"] != clip:
            raise MisconfigurationException(f"gradient_clipping is {config['gradient_clipping']} in the config and "
                                            f"Trainer(gradient_clip_val={clip}): set it once")
        config.setdefault("gradient_clipping", clip)
        precision = self.precision_plugin
        assert isinstance(precision, ZeroshardPrecision)
        for block, value in precision.config.items():
            if block in config and config[block] != value:
                raise MisconfigurationException(f"the config's {block!r} block and Trainer(precision="
                                                f"{precision.precision!r}) disagree: set the precision once")
            config[block] = value
        return config

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self._engine is not None and self._engine.module is module:
            self.model = _as_model(self._engine)  # validate / test / predict after fit: the same engine
            return
        config = self.engine_config(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._engine = self._training_engine(module, config)
        else:  # forward passes only: stages 1-2 keep whole parameters, so stage 0 is the same engine without
            if self.stage < 3:  # optimizer state to shard (which an engine without an optimizer cannot have)
                config["zero_optimization"]["stage"] = 0
            self._engine, *_ = initialize(model=module, config=config, dist_init_required=False)
        self.model = _as_model(self._engine)
        self.barrier()

    def _training_engine(self, module: "pl.LightningModule", config: dict[str, Any]) -> Engine:
        optimizer: Optional[Optimizer] = None
        scheduler_config: Optional[LRSchedulerConfig] = None
        if "optimizer" not in config:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise MisconfigurationException("zeroshard trains with one optimizer and at most one LR scheduler; "
                                                f"configure_optimizers gave {len(optimizers)} and {len(schedulers)}")
            optimizer, scheduler_config = optimizers[0], (schedulers[0] if schedulers else None)
        scheduler = scheduler_config.scheduler if scheduler_config is not None else None
        engine, engine_optimizer, _, engine_scheduler = initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=config, dist_init_required=False)
        assert isinstance(engine, Engine)
        engine.lr_scheduler = None  # Lightning steps the scheduler (by its interval), not the engine
        self.optimizers = [engine_optimizer]
        if scheduler_config is not None:
            scheduler_config.scheduler = engine_scheduler
            self.lr_scheduler_configs = [scheduler_config]
        return engine

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds the model under ``zeroshard.Init`` at stage 3: each rank allocates
        only its shards."""
        config = copy.deepcopy(self.user_config)
        config.setdefault("zero_optimization", {})["stage"] = self.stage
        with Init(config=config, enabled=self.stage == 3):
            yield

    # ------------------------------------------------------------------ checkpoints: the engine's own
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing: the engine writes the weights into its checkpoint (sharded at stage 3)."""
        return {}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Nothing: the engine writes its sharded optimizer state into its checkpoint."""
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Union[str, Path],
                        storage_options: Optional[Any] = None) -> None:
        """Every rank writes its shard of a zeroshard checkpoint at ``filepath``, with Lightning's own
        entries (loops, callbacks, schedulers, hyperparameters) as its client state."""
        if storage_options is not None:
            raise TypeError("Trainer.save_checkpoint(storage_options=...) is not supported with zeroshard: the engine "
                            "writes its checkpoint itself")
        filepath = self.broadcast(filepath)
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag=CHECKPOINT_TAG, client_state=client_state)

    def load_checkpoint(self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a zeroshard checkpoint (at any world size and stage) into the engine; Lightning's entries
        come back as its client state."""
        checkpoint_path = self.broadcast(checkpoint_path)
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, client_state = self.engine.load_checkpoint(checkpoint_path, tag=CHECKPOINT_TAG,
                                                      load_optimizer_states=fitting, load_lr_scheduler_states=False,
                                                      load_module_strict=self.lightning_module.strict_loading)
        if not isinstance(client_state, dict):
            raise FileNotFoundError(f"{checkpoint_path} holds no zeroshard checkpoint written by ZeroshardStrategy "
                                    f"(a directory with {CHECKPOINT_TAG}/manifest.json)")
        return client_state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: ``load_checkpoint`` loaded the weights into the engine."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: ``load_checkpoint`` loaded the optimizer state into the engine."""

    def teardown(self) -> None:
        """Lightning's teardown without moving the module to the CPU: its parameters are the engine's
        (shards at stage 3), and the engine stays open for ``save_checkpoint`` and reads after ``fit``."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for stage in (1, 2, 3):
            name = f"zeroshard_stage_{stage}"
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"zeroshard ZeRO stage {stage}", stage=stage)


def _as_model(engine: Engine) -> nn.Module:
    """The engine where Lightning keeps the wrapped model: Lightning calls it (forward redirected to
    ``training_step``), switches it between train and eval, and compares it with the LightningModule."""
    return cast(nn.Module, engine)


def _micro_batch_size(trainer: "pl.Trainer") -> int:
    """The training loader's batch size (the engine's samples per rank per forward, for its metrics)."""
    source = trainer.fit_loop._data_source
    if source.is_defined():
        sampler = getattr(source.dataloader(), "batch_sampler", None)
        size = getattr(sampler, "batch_size", None)
        if isinstance(size, int):
            return size
    return 1
