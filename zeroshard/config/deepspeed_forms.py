"""DeepSpeed's other ways of writing a config, brought to zeroshard's one form before validation.

[Note: what real configs carry]
Configs written for DeepSpeed, and those Hugging Face and Accelerate generate, carry spellings and
keys that say nothing beyond DeepSpeed's defaults.  Refusing them would make every real config fail;
ignoring keys that *do* ask for something would be silent.  The rule: a key that states DeepSpeed's
default, or a feature block with ``"enabled": false``, describes what zeroshard does anyway and is
dropped here; an alias is renamed to zeroshard's key; everything else reaches the strict loader,
where an unsupported feature that is switched on is refused with the reason.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from ..logging import logger
from .aio import check_aio
from .errors import ConfigError
from .gradient_reduction import normalize_allreduce_op
from .schema import OPTIMIZER_TYPES

#: DeepSpeed keys zeroshard does not implement, with the DeepSpeed default that is zeroshard's own
#: behaviour (by block: "" is the top level).
DEFAULTS_THAT_MATCH: dict[str, dict[str, Any]] = {
    "": {"sparse_gradients": False, "memory_breakdown": False, "dump_state": False},
    "zero_optimization": {
        "round_robin_gradients": False, "load_from_fp32_weights": True,
        "cpu_offload": False, "cpu_offload_param": False, "cpu_offload_use_pin_memory": False,
        "use_multi_rank_bucket_allreduce": True, "stage3_use_all_reduce_for_fetch_params": False,
        "pipeline_loading_checkpoint": False,
    },
    "fp16": {"auto_cast": False, "fp16_master_weights_and_grads": False},
}

#: DeepSpeed feature blocks switched by ``enabled``; switched on, each is refused with this reason.
FEATURE_BLOCKS: dict[str, str] = {
    "wandb": "zeroshard does not log to Weights & Biases; use csv_monitor, tensorboard or metrics_path",
    "comms_logger": "zeroshard always counts its collectives: see comm_mib / comm_s in the metrics and "
                    "engine.comm.snapshot()",
    "flops_profiler": "zeroshard reports an estimated TFLOP/s in every metrics record; use torch.profiler for "
                      "per-module FLOPs",
    "amp": "NVIDIA Apex AMP is not used; use bf16 or fp16",
    "elasticity": "elastic batch sizes are not supported; restarts are torchrun's (--max-restarts)",
    "autotuning": "there is no autotuner",
    "hybrid_engine": "there is no inference engine for RLHF generation",
    "nebula": "checkpoints are zeroshard's own sharded format",
    "data_efficiency": "data sampling and routing are the script's",
    "curriculum_learning": "curriculum learning is the script's data pipeline",
    "eigenvalue": "there is no eigenvalue computation",
    "progressive_layer_drop": "progressive layer drop is not supported",
}

#: DeepSpeed keys of :data:`DEFAULTS_THAT_MATCH` that, set to anything but the default, ask for
#: something zeroshard does not do: refused with this reason (by block, as there).
REFUSED_OTHERWISE: dict[str, dict[str, str]] = {
    "": {
        "memory_breakdown": "zeroshard does not print the allocator's figures at each phase of a step; "
                            "engine.memory_breakdown() gives this rank's bytes by category, and the activations "
                            "a forward saves for backward when it runs inside engine.measure_activations()",
    },
    "zero_optimization": {
        "stage3_use_all_reduce_for_fetch_params": "stage 3 fetches parameters with all-gathers only; the "
                                                  "all-reduce fetch is not implemented",
    },
}

#: DeepSpeed keys that ask, whatever their value, for what zeroshard always does: dropped (by block).
#: ``elastic_checkpoint`` asks for checkpoints that load at another data-parallel degree, which every
#: zeroshard checkpoint does at every stage ([Note: chunks and resharding] in checkpoint/format.py);
#: DeepSpeed deprecates it at stage 3, and zeroshard says so where DeepSpeed warns.
WHATEVER_THE_VALUE: dict[str, tuple[str, ...]] = {"zero_optimization": ("elastic_checkpoint",)}

_ALIASES = {("", "bfloat16"): "bf16",
            ("zero_optimization", "stage3_gather_fp16_weights_on_model_save"):
                "stage3_gather_16bit_weights_on_model_save"}


def normalize(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The config with DeepSpeed's aliases renamed and inert keys dropped (see the Note)."""
    out = _block(dict(raw), "")
    if "aio" in out:  # DeepSpeed's libaio tuning: accepted at its defaults, which ask for nothing here
        check_aio(out.pop("aio"))
    normalize_allreduce_op(out)
    zero = out.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's legacy form: true means stage 1
        out["zero_optimization"] = {"stage": 1 if zero else 0}
    elif isinstance(zero, Mapping):
        out["zero_optimization"] = _block(dict(zero), "zero_optimization")
        leaf = out["zero_optimization"].get("leaf_module")
        if isinstance(leaf, Mapping):
            out["zero_optimization"]["leaf_module"] = _leaf_module_lists(leaf)
    if isinstance(out.get("fp16"), Mapping):
        out["fp16"] = _block(dict(out["fp16"]), "fp16")
    optimizer = out.get("optimizer")
    if isinstance(optimizer, Mapping) and isinstance(optimizer.get("type"), str):
        # DeepSpeed matches optimizer names in any case ("adam", "Adam"; its ADAM_OPTIMIZER is "adam")
        named = {t.lower(): t for t in OPTIMIZER_TYPES}
        out["optimizer"] = {**optimizer, "type": named.get(optimizer["type"].lower(), optimizer["type"])}
    checkpoint = out.get("checkpoint")
    if isinstance(checkpoint, Mapping) and isinstance(checkpoint.get("tag_validation"), str):
        # DeepSpeed reads the mode in any case ("WARN", "warn")
        out["checkpoint"] = {**checkpoint, "tag_validation": checkpoint["tag_validation"].capitalize()}
    for name, reason in FEATURE_BLOCKS.items():
        block = out.get(name)
        if isinstance(block, Mapping):
            if block.get("enabled", False) is False:
                del out[name]
            else:
                raise ConfigError(f"{name + '.enabled'!r} is true, which zeroshard does not support: {reason}; "
                                  f"set it to false or remove the block")
    return out


def _block(block: dict[str, Any], path: str) -> dict[str, Any]:
    for (where, alias), name in _ALIASES.items():
        if where == path and alias in block:
            if name in block:
                raise ConfigError(f"both {alias!r} and {name!r} are set in {path or 'the config'}; they are the same "
                                  f"key under two names: keep {name!r}")
            block[name] = block.pop(alias)
    for name, default in DEFAULTS_THAT_MATCH.get(path, {}).items():
        if name in block and block[name] == default and type(block[name]) is type(default):
            del block[name]
    if path == "zero_optimization":
        _legacy_offload_forms(block)
        if block.get("elastic_checkpoint") is True and block.get("stage") == 3:
            logger.warning("zero_optimization.elastic_checkpoint: ZeRO-3 elastic checkpointing is deprecated in "
                           "DeepSpeed; zeroshard's checkpoints load at any data-parallel degree at every stage, so "
                           "the key is not needed")
    for name in WHATEVER_THE_VALUE.get(path, ()):
        if isinstance(block.get(name), bool):
            del block[name]
    for name, reason in REFUSED_OTHERWISE.get(path, {}).items():
        if name in block:
            default = DEFAULTS_THAT_MATCH[path][name]
            where = f"{path}.{name}" if path else name
            raise ConfigError(f"{where!r} = {json.dumps(block[name])} is not supported: {reason}; set "
                              f"it to {json.dumps(default)} or remove it")
    return block


def _leaf_module_lists(block: Mapping[str, Any]) -> dict[str, Any]:
    """``leaf_module`` as DeepSpeed reads it: a lone string is a list of one, and an entry named twice
    counts once (first place kept)."""
    out = dict(block)
    for name, value in block.items():
        if isinstance(value, str):
            out[name] = [value]
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            out[name] = list(dict.fromkeys(value))
    return out


#: DeepSpeed's deprecated switches for offloading to host memory -> the block each one stands for
_LEGACY_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def _legacy_offload_forms(zero: dict[str, Any]) -> None:
    """DeepSpeed's other ways of writing the offload blocks, in place: a null block is no block, and the
    deprecated ``cpu_offload: true`` / ``cpu_offload_param: true`` are ``{"device": "cpu"}`` blocks
    (false is DeepSpeed's default, dropped with the other defaults)."""
    for name in ("offload_optimizer", "offload_param"):
        if name in zero and zero[name] is None:
            del zero[name]
    for legacy, name in _LEGACY_OFFLOAD.items():
        if zero.get(legacy) is True:
            if name in zero:
                raise ConfigError(f"both 'zero_optimization.{legacy}' and 'zero_optimization.{name}' are set; "
                                  f"{legacy}: true is DeepSpeed's old spelling of {name}: {{\"device\": \"cpu\"}}: "
                                  f"keep {name!r}")
            del zero[legacy]
            zero[name] = {"device": "cpu"}
