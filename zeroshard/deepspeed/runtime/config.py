"""``deepspeed.runtime.config``: ``DeepSpeedConfig`` and ``DeepSpeedConfigError``.

[Note: DeepSpeed's config classes as views]
DeepSpeed's tests, Hugging Face and Accelerate read a parsed config through DeepSpeed's classes
(``DeepSpeedConfig(...).zero_config.stage``, ``.float16_config.enabled``).  Here each of those classes
is a read-only view of zeroshard's one parsed, frozen :class:`~zeroshard.config.schema.ZeroshardConfig`:
every attribute is computed from it when read, so a view can never answer differently from the config
the engine runs with, and the parsing rules (and their errors) are the loader's alone.  The DeepSpeed
keys zeroshard drops because they state DeepSpeed's default ([Note: what real configs carry] in
config/deepspeed_forms.py) answer that default, which is what zeroshard does.  Attributes for features
zeroshard does not have are left out rather than answered with a value that would describe nothing.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist

from ...config.deepspeed_forms import DEFAULTS_THAT_MATCH
from ...config.errors import ConfigError
from ...config.loader import load_config
from ...config.schema import ZeroshardConfig
from .precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
from .zero.config import DeepSpeedZeroConfig

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError", "ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "DEEPSPEED_OPTIMIZERS",
           "TORCH_ADAM_PARAM", "ADAM_W_MODE", "ADAM_W_MODE_DEFAULT"]

#: DeepSpeed's names of the optimizers its config builds (matched in any case; zeroshard builds Adam,
#: AdamW and SGD, and names the others in its error)
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, MUADAM_OPTIMIZER,
                        MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER]
#: the optimizer params keys DeepSpeed reads beside torch's
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True

#: DeepSpeed's error for an invalid config: zeroshard's own (a ``ValueError``), so that ``except
#: DeepSpeedConfigError`` catches every refusal of the loader
DeepSpeedConfigError = ConfigError

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _world() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) without one, as DeepSpeed counts them."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DeepSpeedConfig:
    """A whole config under DeepSpeed's attribute names: ``DeepSpeedConfig(dict_or_path)`` validates it
    with :func:`zeroshard.load_config` (``DeepSpeedConfigError`` for a bad one) and completes the batch
    sizes for the current world; every attribute reads :attr:`zeroshard_config`.  ``mpu`` must be None:
    zeroshard has no model parallelism."""

    __slots__ = ("_config", "global_rank", "world_size")

    def __init__(self, config: Union[str, os.PathLike, Mapping[str, Any], ZeroshardConfig],
                 mpu: Any = None, mesh_device: Any = None) -> None:
        if mpu is not None or mesh_device is not None:
            raise ValueError("DeepSpeedConfig(mpu=..., mesh_device=...): zeroshard has no model or sequence "
                             "parallelism; the batch sizes are completed for the whole world")
        rank, world_size = _world()
        self._config = load_config(config, world_size=world_size)
        self.global_rank = rank
        self.world_size = world_size

    @property
    def zeroshard_config(self) -> ZeroshardConfig:
        """The parsed config every attribute answers from."""
        return self._config

    # ------------------------------------------------------------------ batch
    @property
    def train_batch_size(self) -> Optional[int]:
        return self._config.train_batch_size

    @property
    def train_micro_batch_size_per_gpu(self) -> Optional[int]:
        return self._config.train_micro_batch_size_per_gpu

    @property
    def gradient_accumulation_steps(self) -> Optional[int]:
        return self._config.gradient_accumulation_steps

    @property
    def dataloader_drop_last(self) -> bool:
        return self._config.dataloader_drop_last

    # ------------------------------------------------------------------ ZeRO and communication
    @property
    def zero_config(self) -> DeepSpeedZeroConfig:
        return DeepSpeedZeroConfig.of(self._config.zero_optimization)

    @property
    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization.stage

    @property
    def zero_enabled(self) -> bool:
        return self._config.zero_optimization.stage > 0

    @property
    def zero_allow_untested_optimizer(self) -> bool:
        return self._config.zero_allow_untested_optimizer

    @property
    def zero_force_ds_cpu_optimizer(self) -> bool:
        return self._config.zero_force_ds_cpu_optimizer

    @property
    def communication_data_type(self) -> Optional[torch.dtype]:
        """The dtype gradients are reduced in when the config names one (None: the training dtype)."""
        name = self._config.communication_data_type
        return None if name is None else _DTYPES[name]

    @property
    def grad_accum_dtype(self) -> Optional[str]:
        return self._config.data_types.grad_accum_dtype

    @property
    def prescale_gradients(self) -> bool:
        return self._config.prescale_gradients

    @property
    def gradient_predivide_factor(self) -> float:
        return self._config.gradient_predivide_factor

    @property
    def gradient_allreduce_op(self) -> str:
        """``mean`` or ``sum``, lower case (see config/gradient_reduction.py)."""
        return self._config.gradient_allreduce_op

    @property
    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    # ------------------------------------------------------------------ precision
    @property
    def float16_config(self) -> DeepSpeedFP16Config:
        return DeepSpeedFP16Config.of(self._config.fp16)

    @property
    def bfloat16_config(self) -> DeepSpeedBF16Config:
        return DeepSpeedBF16Config.of(self._config.bf16)

    @property
    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    @property
    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    @property
    def loss_scale(self) -> float:
        """fp16's static loss scale (0: dynamic; 0 too without fp16)."""
        return self._config.fp16.loss_scale if self._config.fp16.enabled else 0.0

    @property
    def initial_dynamic_scale(self) -> int:
        return self.float16_config.initial_dynamic_scale()

    @property
    def dynamic_loss_scale_args(self) -> Optional[dict[str, Any]]:
        """The dynamic scaler's settings under fp16, None without it."""
        return self.float16_config.dynamic_loss_scale_args() if self._config.fp16.enabled else None

    # ------------------------------------------------------------------ optimizer and schedule
    @property
    def optimizer_name(self) -> Optional[str]:
        """The optimizer ``type`` in lower case, as DeepSpeed names its own optimizers (None: no block)."""
        optimizer = self._config.optimizer
        return None if optimizer is None else optimizer.type.lower()

    @property
    def optimizer_params(self) -> Optional[dict[str, Any]]:
        optimizer = self._config.optimizer
        return None if optimizer is None else dict(optimizer.params)

    @property
    def scheduler_name(self) -> Optional[str]:
        scheduler = self._config.scheduler
        return None if scheduler is None else scheduler.type

    @property
    def scheduler_params(self) -> Optional[dict[str, Any]]:
        scheduler = self._config.scheduler
        return None if scheduler is None else dict(scheduler.params)

    # ------------------------------------------------------------------ logging and checkpoints
    @property
    def steps_per_print(self) -> Union[int, float]:
        """An int, or ``inf`` (never) as Hugging Face writes it."""
        value = self._config.steps_per_print
        return int(value) if value != float("inf") else value

    @property
    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    @property
    def memory_breakdown(self) -> bool:
        return bool(DEFAULTS_THAT_MATCH[""]["memory_breakdown"])  # accepted only as its default

    @property
    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._config.checkpoint.tag_validation != "Ignore"

    @property
    def checkpoint_tag_validation_fail(self) -> bool:
        return self._config.checkpoint.tag_validation == "Fail"

    @property
    def load_universal_checkpoint(self) -> bool:
        return self._config.checkpoint.load_universal

    @property
    def use_node_local_storage(self) -> bool:
        return self._config.checkpoint.use_node_local_storage

    def __repr__(self) -> str:
        return f"DeepSpeedConfig({self._config})"
