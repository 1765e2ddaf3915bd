"""``deepspeed.runtime.precision_config``: DeepSpeed's fp16 and bf16 config classes, as read-only views of
zeroshard's ``fp16`` and ``bf16`` blocks (see [Note: DeepSpeed's config classes as views] in
deepspeed/runtime/config.py)."""

from __future__ import annotations

from typing import Any, Mapping

from ...config.deepspeed_forms import DEFAULTS_THAT_MATCH
from ...config.loader import load_config
from ...config.schema import BF16Config, FP16Config
from .config_utils import BlockView

__all__ = ["DeepSpeedFP16Config", "DeepSpeedBF16Config", "get_float16_config", "get_bfloat16_config"]


class DeepSpeedFP16Config(BlockView):
    """``fp16`` under DeepSpeed's names: ``DeepSpeedFP16Config(enabled=True, loss_scale=0, ...)`` parses the
    keys as the config loader does (a ``ConfigError`` for a bad one); every attribute reads the parsed
    block.  DeepSpeed's keys zeroshard drops as defaults (``auto_cast``, ``fp16_master_weights_and_grads``)
    answer those defaults."""

    __slots__ = ()
    _block: FP16Config

    def __init__(self, **fields: Any) -> None:
        super().__init__(load_config({"fp16": fields}).fp16)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in DEFAULTS_THAT_MATCH["fp16"]:
            return DEFAULTS_THAT_MATCH["fp16"][name]
        return getattr(self._block, name)

    def initial_dynamic_scale(self) -> int:
        """The scale dynamic loss scaling starts from (always ``2**initial_scale_power``: [Note: one set of
        loss-scaling defaults] in config/schema.py)."""
        return int(2 ** self._block.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The dynamic scaler's settings under the keyword names of DeepSpeed's loss scaler."""
        block = self._block
        return {"init_scale": self.initial_dynamic_scale(), "scale_window": block.loss_scale_window,
                "delayed_shift": block.hysteresis, "consecutive_hysteresis": block.consecutive_hysteresis,
                "min_scale": block.min_loss_scale}


class DeepSpeedBF16Config(BlockView):
    """``bf16`` under DeepSpeed's names (``enabled``).  DeepSpeed's other bf16 keys answer what zeroshard
    does: no immediate gradient update, fp32 masters, gradients and optimizer state, and a step with a
    non-finite gradient skipped (``check_grad_overflow``: ``max_consecutive_skips``)."""

    __slots__ = ()
    _block: BF16Config
    immediate_grad_update = False
    check_grad_overflow = True
    bf16_master_weights_and_grads = False
    bf16_optimizer_states = False

    def __init__(self, **fields: Any) -> None:
        super().__init__(load_config({"bf16": fields}).bf16)

    @property
    def enabled(self) -> bool:
        return self._block.enabled


def get_float16_config(param_dict: Mapping[str, Any]) -> DeepSpeedFP16Config:
    """The ``fp16`` block of a whole config dict, parsed."""
    return DeepSpeedFP16Config.of(load_config(param_dict).fp16)


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> DeepSpeedBF16Config:
    """The ``bf16`` block (or its older name ``bfloat16``) of a whole config dict, parsed."""
    return DeepSpeedBF16Config.of(load_config(param_dict).bf16)
