"""Every config rule, with the message it gives."""

import json

import pytest

from zeroshard.config import ConfigError, describe_keys, load_config


def err(raw: dict, world_size: int | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(raw, world_size=world_size)
    return str(info.value)


def test_defaults_are_deepspeeds() -> None:
    c = load_config({"train_batch_size": 8}, world_size=2)
    z = c.zero_optimization
    assert (c.gradient_clipping, c.steps_per_print, z.stage) == (0.0, 10, 0)
    assert (z.reduce_bucket_size, z.allgather_bucket_size, z.contiguous_gradients, z.reduce_scatter) == (
        500_000_000, 500_000_000, True, True)


def test_reads_a_json_file(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}))
    assert load_config(str(path), world_size=3).train_batch_size == 6


def test_missing_and_malformed_files(tmp_path) -> None:
    assert "does not exist" in err(str(tmp_path / "nope.json"))  # type: ignore[arg-type]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "not valid JSON" in err(str(bad))  # type: ignore[arg-type]
    bad.write_text("[1, 2]")
    assert "must hold a JSON object" in err(str(bad))  # type: ignore[arg-type]


@pytest.mark.parametrize("raw, derived", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, (32, 4, 2)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, (32, 4, 2)),
    ({"train_batch_size": 16}, (16, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, (12, 3, 1)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, (24, 3, 2)),
])
def test_any_two_batch_keys_derive_the_third(raw: dict, derived: tuple) -> None:
    c = load_config(raw, world_size=4)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == derived


def test_inconsistent_batch_sizes_show_formula_and_world_size() -> None:
    msg = err({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4)
    assert "30 != 4 x 2 x 4" in msg and "world_size is 4" in msg
    msg = err({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 4)
    assert "not a multiple" in msg and "world_size is 4" in msg
    msg = err({"train_batch_size": 30, "gradient_accumulation_steps": 4}, 4)
    assert "not a multiple" in msg and "train_batch_size = train_micro_batch_size_per_gpu" in msg


def test_no_batch_size_is_an_error() -> None:
    assert "set 'train_batch_size' or 'train_micro_batch_size_per_gpu'" in err({}, 2)


def test_unknown_key_suggests_the_right_one() -> None:
    assert "did you mean 'gradient_clipping'?" in err({"gradient_clipp1ng": 1.0})
    assert "did you mean 'zero_optimization.reduce_bucket_size'?" in err(
        {"zero_optimization": {"reduce_bucket_sise": 10}})
    assert "known keys" in err({"zzz": 1})


def test_unsupported_deepspeed_key_is_explicit() -> None:
    assert "'zero_optimization.round_robin_gradients' is a DeepSpeed key that zeroshard does not support yet" in err(
        {"zero_optimization": {"round_robin_gradients": True}})
    assert "'fp16.auto_cast' is a DeepSpeed key" in err({"fp16": {"enabled": True, "auto_cast": True}})
    assert load_config({"fp16": {"enabled": False}, "bf16": {"enabled": False}}).fp16.enabled is False


def test_precision_keys() -> None:
    config = load_config({"fp16": {"enabled": True, "hysteresis": 3}})
    assert (config.fp16.initial_scale_power, config.fp16.hysteresis, config.fp16.loss_scale) == (16, 3, 0.0)
    assert "'fp16.enabled' and 'bf16.enabled' are both true" in err(
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "'communication_data_type' = \"fp16\" does not match the training dtype 'bf16'; use \"fp32\" or " \
           "'bf16'" in err({"bf16": {"enabled": True}, "communication_data_type": "fp16"})
    assert "'data_types.grad_accum_dtype' = \"bf16\" does not match the training dtype 'fp32'" in err(
        {"data_types": {"grad_accum_dtype": "bf16"}})
    assert "'communication_data_type' = \"bf15\" is not one of fp32, fp16, bf16 (did you mean 'bf16'?)" in err(
        {"communication_data_type": "bf15"})
    assert "'fp16.min_loss_scale' = 0 is not allowed" in err({"fp16": {"enabled": True, "min_loss_scale": 0}})
    assert "'fp16.initial_scale_power' = 65 is not allowed" in err({"fp16": {"initial_scale_power": 65}})


def test_activation_checkpointing_keys() -> None:
    config = load_config({"activation_checkpointing": {"cpu_checkpointing": True, "profile": True}})
    assert config.activation_checkpointing.cpu_checkpointing and config.activation_checkpointing.profile
    assert "needs tensor parallelism" in err({"activation_checkpointing": {"partition_activations": True}})
    assert "'activation_checkpointing.contiguous_memory_optimization' = true is not allowed" in err(
        {"activation_checkpointing": {"contiguous_memory_optimization": True}})
    assert "it must be omitted" in err({"activation_checkpointing": {"number_checkpoints": 4}})


@pytest.mark.parametrize("raw, expected", [
    ({"gradient_clipping": "1.0"}, "'gradient_clipping' must be a number"),
    ({"gradient_clipping": -1}, "'gradient_clipping' = -1 is not allowed; it must be a number >= 0"),
    ({"steps_per_print": 0}, "'steps_per_print' = 0 is not allowed; it must be a whole number > 0, or Infinity"),
    ({"steps_per_print": 1.5}, "'steps_per_print' = 1.5 is not allowed; it must be a whole number > 0, or Infinity"),
    ({"train_batch_size": 0}, "'train_batch_size' = 0 is not allowed"),
    ({"zero_optimization": {"stage": 4}}, "'zero_optimization.stage' = 4 is not allowed; it must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": -1}}, "must be a number >= 0"),
    ({"zero_optimization": {"stage3_max_live_parameters": 0}}, "must be a number > 0"),
    ({"zero_optimization": {"overlap_comm": 1}}, "'zero_optimization.overlap_comm' must be true or false"),
    ({"zero_optimization": {"contiguous_gradients": False}}, "must be true (zeroshard always copies"),
    ({"zero_optimization": {"reduce_bucket_size": -5}}, "must be a number > 0"),
    ({"zero_optimization": 3}, "'zero_optimization' must be a JSON object"),
    ({"collective_timeout": 0}, "'collective_timeout' = 0 is not allowed"),
    ({"optimizer": {"type": "AdamWW"}}, "did you mean 'AdamW'?"),
    ({"optimizer": {"type": "Lamb"}}, "'optimizer.type' = \"Lamb\" is not one of Adam, AdamW, SGD"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "'optimizer.params.lr' = -1 is not allowed for AdamW"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, "a list of two numbers in [0, 1)"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}}, "did you mean 'weight_decay'?"),
    ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}}, "SGD takes lr, momentum"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": "yes"}}}, "must be true or false"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "'scheduler.params.total_num_steps' is required"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}}, "one of log, linear"),
    ({"scheduler": {"type": "CyclicLR"}}, "is not one of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"),
    ({"scheduler": {"type": "OneCycle"}}, "'scheduler.params.cycle_min_lr' is required for OneCycle"),
    ({"seed": "x"}, "'seed' must be an integer"),
])
def test_wrong_values_name_the_key_and_what_is_allowed(raw: dict, expected: str) -> None:
    assert expected in err(raw)


def test_floats_written_as_integers_are_accepted() -> None:
    assert load_config({"zero_optimization": {"reduce_bucket_size": 5e8}}).zero_optimization.reduce_bucket_size == 500_000_000


def test_describe_keys_covers_the_schema() -> None:
    keys = {k for k, _, _ in describe_keys()}
    assert {"train_batch_size", "zero_optimization.stage", "optimizer.type", "scheduler.params"} <= keys
    assert all(doc for _, _, doc in describe_keys())


def test_offload_keys() -> None:
    config = load_config({"zero_optimization": {"stage": 3, "sub_group_size": 1000,
                                                "offload_optimizer": {"device": "nvme", "nvme_path": "/x"},
                                                "offload_param": {"device": "cpu"}}})
    zero = config.zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_optimizer.buffer_count, zero.offload_param.buffer_size,
            zero.offload_param.max_in_cpu, zero.sub_group_size) == ("nvme", 4, 100_000_000, 1_000_000_000, 1000)
    assert "'zero_optimization.offload_param' needs ZeRO stage 3" in err(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}})
    assert "'zero_optimization.offload_param.device' nvme needs 'zero_optimization.offload_optimizer' too" in err(
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert load_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}).stage == 3
    assert "'zero_optimization.offload_optimizer' needs ZeRO stage 1, 2 or 3" in err(
        {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert "'zero_optimization.offload_optimizer.device' = \"gpu\" is not one of none, cpu, nvme" in err(
        {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "gpu"}}})
    assert "'zero_optimization.offload_optimizer.buffer_count' = 1 is not allowed; it must be an integer >= 2" in err(
        {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "buffer_count": 1}}})
    assert "did you mean 'zero_optimization.offload_param.max_in_cpu'?" in err(
        {"zero_optimization": {"stage": 3, "offload_param": {"max_in_cpus": 1}}})


def test_what_real_deepspeed_and_hugging_face_configs_carry() -> None:
    config = load_config({
        "steps_per_print": float("inf"), "bfloat16": {"enabled": True}, "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False, "prescale_gradients": False, "gradient_predivide_factor": 1.0,
        "sparse_gradients": False, "wandb": {"enabled": False, "project": "x"}, "comms_logger": {"enabled": False},
        "flops_profiler": {"enabled": False, "profile_step": 1}, "hybrid_engine": {"enabled": False, "max_out_tokens": 512},
        "checkpoint": {"load_universal": True}, "csv_monitor": {"enabled": True, "output_path": "o", "job_name": "j"},
        "fp16": {"enabled": False, "auto_cast": False},
        "zero_optimization": {"stage": 3, "allgather_partitions": True, "round_robin_gradients": False,
                              "ignore_unused_parameters": True, "memory_efficient_linear": False,
                              "stage3_gather_fp16_weights_on_model_save": True, "offload_optimizer": {
                                  "device": "cpu", "nvme_path": None}},
    })
    assert config.steps_per_print == float("inf") and config.bf16.enabled and config.stage == 3
    assert config.zero_optimization.stage3_gather_16bit_weights_on_model_save and config.csv_monitor.job_name == "j"
    assert load_config({"zero_optimization": True}).stage == 1 and load_config({"zero_optimization": False}).stage == 0
    assert config["zero_optimization"]["stage"] == 3 and "bf16" in config  # readable as DeepSpeed's dict


@pytest.mark.parametrize("raw, message", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": float("inf")}}}, "'optimizer.params.lr' = inf is not a finite"),
    ({"gradient_clipping": float("nan")}, "'gradient_clipping' = nan is not a finite number"),
    ({"wandb": {"enabled": True}}, "'wandb.enabled' is true, which zeroshard does not support: zeroshard does not log"),
    ({"zero_optimization": {"allgather_partitions": False}}, "it must be true (zeroshard always all-gathers"),
    ({"zero_optimization": {"reduce_bucket_size": "auto"}}, "'zero_optimization.reduce_bucket_size' is \"auto\""),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "both 'bfloat16' and 'bf16' are set"),
    ({"zero_optimization": {"round_robin_gradients": True}}, "does not support yet"),
])
def test_deepspeed_forms_that_are_refused(raw, message) -> None:
    assert message in err(raw)


def test_periodic_saves_and_auto_resume_need_a_directory() -> None:
    base = {"train_batch_size": 2}
    for key, value in (("save_interval", 5), ("auto_resume", True)):
        assert f"'checkpoint.{key}' needs 'checkpoint.save_dir'" in err({**base, "checkpoint": {key: value}})
    assert "'checkpoint.keep_last' applies to periodic saves" in err(
        {**base, "checkpoint": {"save_dir": "c", "keep_last": 2}})
    assert "'checkpoint.save_interval' = -1 is not allowed" in err({**base, "checkpoint": {"save_dir": "c",
                                                                                          "save_interval": -1}})


def test_node_local_storage_needs_a_sharded_stage() -> None:
    assert "'checkpoint.use_node_local_storage' needs ZeRO stage 1, 2 or 3" in err(
        {"train_batch_size": 2, "checkpoint": {"use_node_local_storage": True}})
    load_config({"train_batch_size": 2, "zero_optimization": {"stage": 1},
                 "checkpoint": {"use_node_local_storage": True}})


def test_hybrid_sharding_keys_are_checked_with_the_fix() -> None:
    def zero(**keys: object) -> dict:
        return {"train_batch_size": 4, "zero_optimization": keys}
    assert load_config(zero(stage=3, mics_shard_size=2)).zero_optimization.mics_shard_size == 2
    assert load_config(zero(stage=1, mics_shard_size=2)).zero_optimization.mics_shard_size == 2
    assert load_config(zero(stage=3, zero_hpz_partition_size=8)).zero_optimization.zero_hpz_partition_size == 8
    # DeepSpeed's defaults are what zeroshard does without them
    default = load_config(zero(stage=3, mics_shard_size=-1, zero_hpz_partition_size=1,
                               mics_hierarchical_params_gather=False)).zero_optimization
    assert (default.mics_shard_size, default.zero_hpz_partition_size) == (-1, 1)
    assert "'zero_optimization.mics_shard_size' needs ZeRO stage 1, 2 or 3" in err(zero(stage=0, mics_shard_size=2))
    assert "'zero_optimization.zero_hpz_partition_size' needs ZeRO stage 3" in err(
        zero(stage=2, zero_hpz_partition_size=2))
    assert "choose one" in err(zero(stage=3, mics_shard_size=2, zero_hpz_partition_size=2))
    assert "'zero_optimization.mics_shard_size' = 0" in err(zero(stage=3, mics_shard_size=0))
    assert "'zero_optimization.mics_hierarchical_params_gather'" in err(
        zero(stage=3, mics_shard_size=2, mics_hierarchical_params_gather=True))
    assert "not supported together with offload" in err(
        zero(stage=3, zero_hpz_partition_size=2, offload_optimizer={"device": "cpu"}))
    assert "'checkpoint.use_node_local_storage' is not supported with" in err(
        {**zero(stage=3, mics_shard_size=2), "checkpoint": {"use_node_local_storage": True}})


def test_tag_validation_reads_deepspeeds_modes_in_any_case() -> None:
    for written, read in (("WARN", "Warn"), ("fail", "Fail"), ("Ignore", "Ignore")):
        assert load_config({"train_batch_size": 1, "checkpoint": {"tag_validation": written}}
                           ).checkpoint.tag_validation == read
    assert load_config({"train_batch_size": 1}).checkpoint.tag_validation == "Warn"
    with pytest.raises(ConfigError, match="tag_validation"):
        load_config({"train_batch_size": 1, "checkpoint": {"tag_validation": "foobar"}})


def test_gradient_allreduce_op_reads_deepspeeds_values_in_any_case() -> None:
    assert load_config({}).gradient_allreduce_op == "mean"
    assert load_config({"gradient_allreduce_op": "SUM"}).gradient_allreduce_op == "sum"
    assert load_config({"gradient_allreduce_op": "Mean"}).gradient_allreduce_op == "mean"


@pytest.mark.parametrize("raw, message", [
    ({"gradient_allreduce_op": "max"}, 'Invalid gradient_allreduce_op "max"'),
    ({"gradient_allreduce_op": 1}, "Invalid gradient_allreduce_op 1"),
    ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}, "not supported with ZeRO stage 3"),
    ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 2, "zenflow": {}}}, "not supported with ZenFlow"),
    ({"gradient_allreduce_op": "sum", "compile": {"deepcompile": True}}, "not supported with DeepCompile"),
])
def test_gradient_allreduce_op_refusals(raw, message) -> None:
    assert message in err(raw)


def test_gradient_allreduce_op_sum_divides_nothing() -> None:
    import torch

    from zeroshard.precision import PrecisionPolicy

    for prescale in (False, True):
        config = load_config({"gradient_allreduce_op": "sum", "prescale_gradients": prescale,
                              "gradient_predivide_factor": 4.0})
        policy = PrecisionPolicy.from_config(config)
        grad = torch.full((3,), 6.0)
        policy.before_reduction(grad, world_size=3)
        policy.after_reduction(grad, world_size=3)
        assert grad.tolist() == [6.0] * 3 and not policy.scales_after_reduction
    mean = PrecisionPolicy.from_config(load_config({}))
    grad = torch.full((3,), 6.0)
    mean.before_reduction(grad, world_size=3)
    assert grad.tolist() == [2.0] * 3


HJSON_TEXT = """{
  # comments, unquoted keys and no commas: HJSON, as DeepSpeed reads config files
  train_micro_batch_size_per_gpu: 2
  zero_optimization: {stage: 2}
}"""


def test_reads_an_hjson_file_when_hjson_is_installed(tmp_path) -> None:
    pytest.importorskip("hjson")
    path = tmp_path / "ds.json"
    path.write_text(HJSON_TEXT)
    config = load_config(str(path), world_size=1)
    assert (config.train_micro_batch_size_per_gpu, config.stage) == (2, 2)
    path.write_text("{ train_batch_size: [ }")
    assert "neither valid JSON" in err(str(path))  # type: ignore[arg-type]


def test_an_hjson_file_without_hjson_names_the_package(tmp_path, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "hjson", None)  # the import fails, as without the package
    path = tmp_path / "ds.json"
    path.write_text(HJSON_TEXT)
    message = err(str(path))  # type: ignore[arg-type]
    assert "not valid JSON" in message and "pip install hjson" in message


def test_elastic_checkpoint_asks_for_what_every_checkpoint_does(caplog) -> None:
    """``elastic_checkpoint`` (checkpoints that load at another data-parallel degree) is what zeroshard's
    checkpoints always do: accepted either way; at stage 3, where DeepSpeed deprecates it, with a warning."""
    import logging

    for stage in (1, 2, 3):
        for value in (True, False):
            with caplog.at_level(logging.WARNING, logger="zeroshard"):
                caplog.clear()
                load_config({"zero_optimization": {"stage": stage, "elastic_checkpoint": value}})
            warned = any("elastic checkpointing is deprecated" in r.getMessage() for r in caplog.records)
            assert warned == (stage == 3 and value), (stage, value)
    with pytest.raises(ConfigError):
        load_config({"zero_optimization": {"stage": 1, "elastic_checkpoint": "yes"}})


def test_deepspeeds_compile_block_takes_only_deepcompile_off() -> None:
    """``compile`` is DeepSpeed's DeepCompile block: off is accepted (it is DeepSpeed's default), on is
    refused by name, and DeepCompile's other keys (which do nothing without it) are unknown keys."""
    assert load_config({"compile": {"deepcompile": False}}).compile.deepcompile is False
    assert "DeepSpeed's DeepCompile graph passes, which zeroshard does not have" in err({"compile": {"deepcompile": True}})
    assert "unknown config key 'compile.offload_activation'" in err({"compile": {"offload_activation": True}})


def test_deepspeeds_aio_block_at_its_defaults_is_accepted_and_anything_else_refused_by_name() -> None:
    """DeepSpeed's ``aio`` block as Lightning writes it out (every key at DeepSpeed's default, the intra-op
    count under its older name ``thread_count``) asks for nothing and loads; a value that would tune an
    I/O path zeroshard does not have is refused with the key named, as is a key DeepSpeed does not know."""
    lightning_block = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True,
                       "thread_count": 1}
    assert load_config({"aio": lightning_block}) == load_config({})
    assert load_config({"aio": {"intra_op_parallelism": 1, "use_gds": False}}) == load_config({})
    assert "'aio.queue_depth' = 32 would do nothing" in err({"aio": {"queue_depth": 32}})
    assert "'aio.thread_count' = 4 would do nothing" in err({"aio": {"thread_count": 4}})
    assert "'aio.overlap_events' = false would do nothing" in err({"aio": {"overlap_events": False}})
    assert "'aio.use_gds' = true would do nothing" in err({"aio": {"use_gds": True}})
    assert "'aio.block_size' = 2 would do nothing" in err({"aio": {"block_size": 2}})
    assert "unknown config key 'aio.depth'" in err({"aio": {"depth": 8}})
    assert "same key under two names" in err({"aio": {"thread_count": 1, "intra_op_parallelism": 1}})


def test_a_default_deepspeed_moved_is_kept_and_said_once_when_the_key_is_left_out(monkeypatch) -> None:
    """DeepSpeed 0.19.3 moved gradient_clipping's default from 0 to 1.0; zeroshard reports an older
    DeepSpeed and keeps its default, 0, saying so once per process when a config leaves the key out
    (bumping the reported version past the move must revisit the default: the last assertion fails)."""
    from packaging.version import Version

    from zeroshard.config import kept_defaults
    from zeroshard.deepspeed.install import DEEPSPEED_VERSION

    monkeypatch.setattr(kept_defaults, "_ANNOUNCED", set())
    assert kept_defaults.announce_kept_defaults({"gradient_clipping": "auto"}) == []
    assert kept_defaults.announce_kept_defaults({}) == ["gradient_clipping"]
    assert kept_defaults.announce_kept_defaults({}) == []
    moved = kept_defaults.MOVED_DEFAULTS["gradient_clipping"]
    assert load_config({}).gradient_clipping == moved.kept == 0.0
    assert Version(DEEPSPEED_VERSION) < Version(moved.since)
