"""Turn a DeepSpeed-style JSON file or dict into a validated :class:`ZeroshardConfig`.

Every rule here produces a :class:`ConfigError` that names the dotted key and says what would be
accepted, so that a typo (``gradient_clipp1ng``) or a wrong type never passes silently.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Union

from .deepspeed_forms import normalize
from .errors import ConfigError
from .fp8_block import check_fp8
from .gradient_reduction import check_allreduce_op
from .schema import NOT_SUPPORTED_YET, OptimizerConfig, SchedulerConfig, ZeroConfig, ZeroshardConfig
from .tensor_plan import check_tensor_parallel
from .spec_params import OPTIMIZER_PARAMS, SCHEDULER_PARAMS, ParamSpec


def load_config(source: Union[str, os.PathLike, Mapping[str, Any], ZeroshardConfig, None],
                world_size: int | None = None) -> ZeroshardConfig:
    """Read, validate and complete a config.

    ``source`` is a path to a JSON file, a dict, an already-built config, or ``None`` (all defaults).
    With ``world_size``, the three batch-size keys are completed and checked against each other.
    """
    if isinstance(source, ZeroshardConfig):
        config = source
    else:
        raw = normalize(_read(source))
        config = _build(ZeroshardConfig, raw, "")
        _check_params(config)
        _check_precision(config)
        _check_offload(config)
        _check_checkpointing(config)
        _check_hybrid(config)
        _check_quantised_gathers(config)
        _check_sequence_parallel(config)
        _check_compile(config)
        check_allreduce_op(config.gradient_allreduce_op, config.stage)
        check_tensor_parallel(config.tensor_parallel)
        check_fp8(config.fp8, config.fp16.enabled, config.zero_optimization.zero_hpz_partition_size)
    if world_size is not None:
        config = resolve_batch_sizes(config, world_size)
    return config


def load_zero_block(raw: Mapping[str, Any]) -> ZeroConfig:
    """The ``zero_optimization`` block alone, DeepSpeed's spellings included, as DeepSpeed's ZeRO config
    class parses it: the rules that relate it to the rest of a config (offload_param needs stage 3, ...)
    are checked when a whole config is loaded, which is the only way one reaches an engine."""
    block = normalize({"zero_optimization": dict(raw)})["zero_optimization"]
    return _build(ZeroConfig, block, "zero_optimization")


def read_config_source(source: Any) -> dict:
    """The raw JSON object of a config source (a path or a mapping), before validation."""
    return _read(source)


def without_auto(raw: Mapping[str, Any]) -> dict:
    """``raw`` without the keys whose value is ``"auto"`` (at any depth): what ``zero.Init`` reads of a
    Hugging Face config before the Trainer has filled those values in (it needs none of them)."""
    return {k: without_auto(v) if isinstance(v, Mapping) else v for k, v in raw.items() if v != "auto"}


def _read(source: Any) -> dict:
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    data = _parse(path.read_text(), path)
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a JSON object, not {type(data).__name__}")
    return data


def _parse(text: str, path: Path) -> Any:
    """A config file's object: JSON, or else HJSON (JSON with comments, unquoted keys and strings,
    optional commas), which DeepSpeed reads its config files as, when the ``hjson`` package is
    installed.  zeroshard does not require it: a plain JSON file, the usual case, never needs it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        json_error = err
    try:
        import hjson
    except ImportError:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {json_error} (for an HJSON file, install "
                          f"the hjson package: pip install hjson)") from None
    try:
        return hjson.loads(text, object_pairs_hook=dict)
    except hjson.HjsonDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is neither valid JSON ({json_error}) nor valid HJSON "
                          f"({err})") from None


def _dotted(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _unknown_key(path: str, name: str, known: list[str]) -> ConfigError:
    where = _dotted(path, name)
    if name in NOT_SUPPORTED_YET.get(path, ()):
        return ConfigError(f"{where!r} is a DeepSpeed key that zeroshard does not support yet; "
                           f"remove it from the config")
    close = difflib.get_close_matches(name, known + list(NOT_SUPPORTED_YET.get(path, ())), n=1, cutoff=0.6)
    hint = f"; did you mean {_dotted(path, close[0])!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
    return ConfigError(f"unknown config key {where!r}{hint}")


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'the config'!r} must be a JSON object, got {_show(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in data:
        if name not in fields:
            raise _unknown_key(path, name, list(fields))
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        dotted = _dotted(path, name)
        if value == "auto":
            raise ConfigError(f"{dotted!r} is \"auto\": Hugging Face's Trainer fills \"auto\" values in before it "
                              f"calls initialize(); outside it, give a value (or remove the key for the default)")
        if isinstance(value, float) and not math.isfinite(value) and not fields[name].metadata.get("infinite_ok"):
            raise ConfigError(f"{dotted!r} = {value} is not a finite number; give a finite value")
        converted = _convert(hints[name], value, dotted)
        check = fields[name].metadata.get("check")
        problem = check(converted) if check is not None and converted is not None else None
        if problem:
            raise ConfigError(f"{dotted!r} = {_show(value)} is not allowed; it must be {problem}")
        values[name] = converted
    return cls(**values)


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__


def _convert(hint: Any, value: Any, dotted: str) -> Any:
    """Check ``value`` against the annotation ``hint`` and return it in the annotated type."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return None if value is None else _convert(args[0], value, dotted)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            same_case = [str(c) for c in choices if str(c).lower() == str(value).lower()]
            close = same_case or difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint_text = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{dotted!r} = {_show(value)} is not one of {', '.join(map(str, choices))}{hint_text}")
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, dotted)
    return _scalar(hint, value, dotted)


def _scalar(hint: Any, value: Any, dotted: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{dotted!r} must be true or false, got {_show(value)}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
            raise ConfigError(f"{dotted!r} must be an integer, got {_show(value)}")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{dotted!r} must be a number, got {_show(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{dotted!r} must be a string, got {_show(value)}")
        return value
    if hint is list:
        if not isinstance(value, list):
            raise ConfigError(f"{dotted!r} must be a JSON array, got {_show(value)}")
        return list(value)
    if hint is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{dotted!r} must be a JSON object, got {_show(value)}")
        return dict(value)
    raise TypeError(f"config schema uses an unsupported annotation {hint!r} at {dotted}")


def _check_precision(config: ZeroshardConfig) -> None:
    """The precision keys that depend on each other (see zeroshard/precision/policy.py)."""
    if config.fp16.enabled and config.bf16.enabled:
        raise ConfigError("'fp16.enabled' and 'bf16.enabled' are both true; mixed precision uses one 16-bit "
                          "format: set one of them to false")
    training = "fp16" if config.fp16.enabled else "bf16" if config.bf16.enabled else "fp32"
    for dotted, value in (("communication_data_type", config.communication_data_type),
                          ("data_types.grad_accum_dtype", config.data_types.grad_accum_dtype)):
        if value is not None and value not in ("fp32", training):
            raise ConfigError(f"{dotted!r} = {_show(value)} does not match the training dtype {training!r}; "
                              f"use \"fp32\" or {training!r} (or omit the key for the default)")


def _check_offload(config: ZeroshardConfig) -> None:
    zero = config.zero_optimization
    for block, name in ((zero.offload_optimizer, "offload_optimizer"), (zero.offload_param, "offload_param")):
        if block.device == "nvme" and block.nvme_path is None:
            raise ConfigError(f"'zero_optimization.{name}.device' is nvme but 'zero_optimization.{name}.nvme_path' "
                              f"is null; give the directory for the swap files")
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        raise ConfigError("'zero_optimization.offload_optimizer' needs ZeRO stage 1, 2 or 3 (the offloaded "
                          "optimizer updates this rank's shard); set 'zero_optimization.stage' to 1 or more")
    if zero.offload_param.device != "none":
        if zero.stage != 3:
            raise ConfigError(f"'zero_optimization.offload_param' needs ZeRO stage 3 (only stage 3 shards the "
                              f"parameters); the config says stage {zero.stage}: set 'zero_optimization.stage' to "
                              f"3 or remove offload_param")
        if zero.offload_param.device == "nvme" and zero.offload_optimizer.device == "none":
            raise ConfigError("'zero_optimization.offload_param.device' nvme needs 'zero_optimization.offload_optimizer' "
                              "too (parameter shards swapped to files are updated by an optimizer off the device); set "
                              "its device to cpu or nvme, or offload the parameters to cpu")


def _check_checkpointing(config: ZeroshardConfig) -> None:
    ckpt = config.checkpoint
    for name, used in (("save_interval", ckpt.save_interval > 0), ("keep_last", ckpt.keep_last > 0),
                       ("auto_resume", ckpt.auto_resume)):
        if used and not ckpt.save_dir:
            raise ConfigError(f"'checkpoint.{name}' needs 'checkpoint.save_dir': give the directory the "
                              f"checkpoints go to")
    if ckpt.use_node_local_storage and config.stage == 0:
        raise ConfigError("'checkpoint.use_node_local_storage' needs ZeRO stage 1, 2 or 3 (at stage 0 rank 0 writes "
                          "the whole model, so other nodes would not have it); set 'zero_optimization.stage'")
    if ckpt.keep_last > 0 and ckpt.save_interval == 0:
        raise ConfigError("'checkpoint.keep_last' applies to periodic saves: set 'checkpoint.save_interval' too")


def _check_hybrid(config: ZeroshardConfig) -> None:
    """MiCS and hpZ: which stages they apply to, and what they are not combined with (yet)."""
    zero = config.zero_optimization
    mics, hpz = zero.mics_shard_size > 0, zero.zero_hpz_partition_size > 1
    if mics and zero.stage == 0:
        raise ConfigError("'zero_optimization.mics_shard_size' needs ZeRO stage 1, 2 or 3 (it says over how many "
                          "ranks the state is sharded; stage 0 shards nothing): set the stage or remove the key")
    if hpz and zero.stage != 3:
        raise ConfigError(f"'zero_optimization.zero_hpz_partition_size' needs ZeRO stage 3 (it partitions the "
                          f"parameters a second time); the config says stage {zero.stage}: set "
                          f"'zero_optimization.stage' to 3 or the key to 1")
    if mics and hpz:
        raise ConfigError("'zero_optimization.mics_shard_size' and 'zero_optimization.zero_hpz_partition_size' "
                          "are two answers to the same cost (gathers across nodes): choose one, set the other "
                          "to its default (-1 / 1)")
    if (mics or hpz) and (zero.offload_optimizer.device != "none" or zero.offload_param.device != "none"):
        key = "mics_shard_size" if mics else "zero_hpz_partition_size"
        raise ConfigError(f"'zero_optimization.{key}' is not supported together with offload_optimizer / "
                          f"offload_param yet; remove the offload blocks or the hybrid sharding key")
    if mics and config.checkpoint.use_node_local_storage:
        raise ConfigError("'checkpoint.use_node_local_storage' is not supported with "
                          "'zero_optimization.mics_shard_size' yet (the first shard group writes every shard); "
                          "save to a shared directory")


def _check_quantised_gathers(config: ZeroshardConfig) -> None:
    """ZeRO++'s qwZ quantises stage 3's gathers: refused where there are none, and beside FP8 gathers,
    which would claim the same buckets; qgZ replaces the reduce-scatter to each chunk's owner: refused
    where there is none (stage 0, ``reduce_scatter: false``) and beside MiCS."""
    zero = config.zero_optimization
    for name in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        if getattr(zero, name) and zero.stage != 3:
            raise ConfigError(f"'zero_optimization.{name}' needs ZeRO stage 3 (it quantises stage 3's parameter "
                              f"gathers; stages 0-2 gather nothing for compute); the config says stage "
                              f"{zero.stage}: set 'zero_optimization.stage' to 3 or the key to false")
    if zero.zero_quantized_gradients:
        if zero.stage == 0:
            raise ConfigError("'zero_optimization.zero_quantized_gradients' needs ZeRO stage 1, 2 or 3 (it replaces "
                              "the reduce-scatter of gradients to their owners; stage 0 all-reduces them): set "
                              "'zero_optimization.stage' or the key to false")
        if not zero.reduce_scatter:
            raise ConfigError("'zero_optimization.zero_quantized_gradients' with 'zero_optimization.reduce_scatter': "
                              "false: qgZ is a reduction to each chunk's owner; remove one of the two")
        if zero.mics_shard_size > 0:
            raise ConfigError("'zero_optimization.zero_quantized_gradients' with 'zero_optimization.mics_shard_size' "
                              "is not supported (the replicas' all-reduce would stay unquantised); choose one")
    fp8 = config.fp8
    if zero.zero_quantized_weights and fp8.enabled and fp8.gather_weights_in_fp8:
        raise ConfigError("'zero_optimization.zero_quantized_weights' with 'fp8.gather_weights_in_fp8': both "
                          "would compress the FP8 layers' weight gathers; set 'fp8.gather_weights_in_fp8' to "
                          "false (int8 gathers of every weight) or 'zero_quantized_weights' to false")


def _check_compile(config: ZeroshardConfig) -> None:
    if config.compile.deepcompile:
        raise ConfigError("'compile.deepcompile' = true asks for DeepSpeed's DeepCompile graph passes, which zeroshard "
                          "does not have; remove it and compile with engine.compile() (DeepSpeed's method) or "
                          "torch.compile(model): zeroshard keeps its ZeRO hooks outside the compiled graphs")


def _check_sequence_parallel(config: ZeroshardConfig) -> None:
    block = config.sequence_parallel
    if block.mode == "ulysses" and not block.causal:
        raise ConfigError("'sequence_parallel.causal' = false has no effect with mode \"ulysses\" (the local "
                          "attention decides the mask there); remove it, or set 'sequence_parallel.mode' to \"ring\"")
    if block.mode == "ulysses" and block.load_balance:
        raise ConfigError("'sequence_parallel.load_balance' needs 'sequence_parallel.mode' \"ring\" (Ulysses holds "
                          "consecutive slices); remove it, or set the mode to \"ring\"")


def _check_params(config: ZeroshardConfig) -> None:
    if config.optimizer is not None:
        spec = OPTIMIZER_PARAMS[config.optimizer.type]
        _check_param_block(config.optimizer.params, spec, "optimizer.params", config.optimizer.type)
    if config.scheduler is not None:
        spec = SCHEDULER_PARAMS[config.scheduler.type]
        _check_param_block(config.scheduler.params, spec, "scheduler.params", config.scheduler.type)


def _check_param_block(params: dict, spec: dict[str, ParamSpec], path: str, type_name: str) -> None:
    for name, value in params.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{path + '.' + name!r} = {value} is not a finite number; give a finite value")
        if name not in spec:
            close = difflib.get_close_matches(name, list(spec), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; {type_name} takes {', '.join(spec)}"
            raise ConfigError(f"unknown config key {path + '.' + name!r} for {type_name}{hint}")
        problem = spec[name].problem(value)
        if problem:
            raise ConfigError(f"{path + '.' + name!r} = {_show(value)} is not allowed for {type_name}; "
                              f"it must be {problem}")
    for name, s in spec.items():
        if s.required and name not in params:
            raise ConfigError(f"{path + '.' + name!r} is required for {type_name}")


def resolve_batch_sizes(config: ZeroshardConfig, world_size: int) -> ZeroshardConfig:
    """Derive the missing batch key; refuse inconsistent ones with the formula and the world size.

    ``train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size``.
    """
    total = config.train_batch_size
    micro = config.train_micro_batch_size_per_gpu
    accum = config.gradient_accumulation_steps
    formula = ("train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
               f"world_size (world_size is {world_size})")
    if total is None and micro is None:
        raise ConfigError("set 'train_batch_size' or 'train_micro_batch_size_per_gpu' (or both); " + formula)
    if total is not None and micro is not None and accum is not None:
        if total != micro * accum * world_size:
            raise ConfigError(f"inconsistent batch sizes: {total} != {micro} x {accum} x {world_size}; "
                              + formula)
    elif total is not None and micro is not None:
        accum, rest = divmod(total, micro * world_size)
        if rest or accum == 0:
            raise ConfigError(f"train_batch_size {total} is not a multiple of train_micro_batch_size_per_gpu "
                              f"{micro} x world_size {world_size}; " + formula)
    elif total is not None:
        accum = accum or 1
        micro, rest = divmod(total, accum * world_size)
        if rest or micro == 0:
            raise ConfigError(f"train_batch_size {total} is not a multiple of gradient_accumulation_steps "
                              f"{accum} x world_size {world_size}; " + formula)
    else:
        assert micro is not None
        accum = accum or 1
        total = micro * accum * world_size
    return dataclasses.replace(config, train_batch_size=total, train_micro_batch_size_per_gpu=micro,
                               gradient_accumulation_steps=accum)


@dataclasses.dataclass(frozen=True)
class DocumentedKey:
    """One supported key as the configuration reference shows it."""

    key: str  #: dotted, as written in the JSON (``zero_optimization.stage``)
    default: Any  #: the value a config that omits the key gets
    doc: str  #: what the key means (Markdown)
    default_text: str | None  #: how the reference shows the default where the value alone misleads


def documented_keys() -> list[DocumentedKey]:
    """Every supported key in the schema's field order, nested blocks in place, with the default a config
    that omits it gets (``checkpoint.writer.type`` is "python" without a writer block)."""
    return list(_documented_fields(ZeroshardConfig, ZeroshardConfig(), ""))


def _documented_fields(cls: type, defaults: Any, path: str) -> typing.Iterator[DocumentedKey]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        dotted = _dotted(path, f.name)
        default = getattr(defaults, f.name)
        block = _block_class(hints[f.name])
        if block is not None:
            yield from _documented_fields(block, default if default is not None else block(), dotted)
        else:
            yield DocumentedKey(dotted, default, f.metadata.get("doc", ""), f.metadata.get("default_text"))


def _block_class(hint: Any) -> type | None:
    """The dataclass of a nested block (``ZeroConfig``, ``Optional[OptimizerConfig]``), or None for a key."""
    nested = [a for a in (hint, *typing.get_args(hint)) if isinstance(a, type) and dataclasses.is_dataclass(a)]
    return nested[0] if nested else None


def describe_keys() -> list[tuple[str, Any, str]]:
    """(dotted key, default, doc) for every supported key: the rows of docs/CONFIGURATION.md's key table,
    which ``python -m zeroshard.config.reference`` renders (a test checks the page matches)."""
    return [(k.key, k.default, k.doc) for k in documented_keys()]


__all__ = ["ConfigError", "load_config", "resolve_batch_sizes", "describe_keys",
           "OptimizerConfig", "SchedulerConfig"]
