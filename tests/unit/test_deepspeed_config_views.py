"""DeepSpeed's config classes answer from the zeroshard config they were built from, defaults included."""

from __future__ import annotations

import json

import pytest
import torch

from zeroshard.config import ConfigError, load_config
from zeroshard.config.deepspeed_forms import DEFAULTS_THAT_MATCH
from zeroshard.deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from zeroshard.deepspeed.runtime.config_utils import (ScientificNotationEncoder, dict_raise_error_on_duplicate_keys,
                                                     get_scalar_param)
from zeroshard.deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config, get_float16_config
from zeroshard.deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
from zeroshard.deepspeed.runtime.zero.linear import zero3_linear_wrap
from zeroshard.optim.fused_adam import DeepSpeedCPUAdam, FusedAdam

RAW = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "gradient_clipping": 0.5,
       "steps_per_print": 7, "wall_clock_breakdown": True, "dataloader_drop_last": True,
       "fp16": {"enabled": True, "loss_scale_window": 500, "hysteresis": 3, "auto_cast": False},
       "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "torch_adam": True}},
       "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
       "checkpoint": {"tag_validation": "fail"},
       "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1234, "reduce_bucket_size": 99,
                             "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                             "stage3_use_all_reduce_for_fetch_params": False}}


def test_deepspeed_config_reads_the_parsed_config() -> None:
    view = DeepSpeedConfig(RAW)
    ours = view.zeroshard_config
    assert ours == load_config(RAW, world_size=1)
    assert (view.train_batch_size, view.train_micro_batch_size_per_gpu, view.gradient_accumulation_steps) == (6, 2, 3)
    assert view.world_size == 1 and view.global_rank == 0
    assert view.gradient_clipping == 0.5 and view.steps_per_print == 7 and view.wall_clock_breakdown
    assert view.dataloader_drop_last and not view.memory_breakdown
    assert view.zero_enabled and view.zero_optimization_stage == 3 == view.zero_config.stage
    assert view.fp16_enabled and not view.bfloat16_enabled and view.float16_config.enabled
    assert view.loss_scale == 0 and view.initial_dynamic_scale == 2 ** 16
    assert view.dynamic_loss_scale_args == {"init_scale": 2 ** 16, "scale_window": 500, "delayed_shift": 3,
                                            "consecutive_hysteresis": False, "min_scale": 1.0}
    assert view.optimizer_name == "adam" and view.optimizer_params == {"lr": 2e-4, "torch_adam": True}
    assert view.scheduler_name == "WarmupLR" and view.scheduler_params == {"warmup_num_steps": 10}
    assert view.checkpoint_tag_validation_enabled and view.checkpoint_tag_validation_fail
    assert view.communication_data_type is None and view.grad_accum_dtype is None
    with pytest.raises(AttributeError):
        view.train_batch_size = 1  # type: ignore[misc]


def test_deepspeed_config_defaults() -> None:
    view = DeepSpeedConfig({"train_batch_size": 4})
    assert view.gradient_accumulation_steps == 1 and view.train_micro_batch_size_per_gpu == 4
    assert not view.zero_enabled and view.zero_config.stage is ZeroStageEnum.disabled
    assert not view.fp16_enabled and not view.bfloat16_enabled and view.dynamic_loss_scale_args is None
    assert view.optimizer_name is None and view.optimizer_params is None and view.scheduler_name is None
    assert view.steps_per_print == 10 and view.gradient_clipping == 0.0
    assert view.checkpoint_tag_validation_enabled and not view.checkpoint_tag_validation_fail
    zero = view.zero_config
    assert zero.offload_param is None and zero.offload_optimizer is None
    assert (zero.prefetch_bucket_size, zero.param_persistence_threshold, zero.max_live_parameters,
            zero.max_reuse_distance, zero.sub_group_size) == (50_000_000, 100_000, 10 ** 9, 10 ** 9, 10 ** 9)
    assert zero.reduce_bucket_size == zero.allgather_bucket_size == 500_000_000
    assert zero.contiguous_gradients and zero.reduce_scatter and not zero.gather_16bit_weights_on_model_save
    assert zero.use_all_reduce_for_fetch_params is False and zero.round_robin_gradients is False
    assert DeepSpeedConfig({"train_batch_size": 4, "steps_per_print": float("inf")}).steps_per_print == float("inf")


def test_zero_view_answers_each_field_of_its_block() -> None:
    block = load_config(RAW).zero_optimization
    view = DeepSpeedConfig(RAW).zero_config
    assert view.prefetch_bucket_size == block.stage3_prefetch_bucket_size == 1234
    assert view.reduce_bucket_size == block.reduce_bucket_size == 99
    assert view.overlap_comm == block.overlap_comm
    assert view.offload_param._block == block.offload_param and view.offload_param.device == "cpu"
    assert view.offload_optimizer._block == block.offload_optimizer
    for name, default in DEFAULTS_THAT_MATCH["zero_optimization"].items():
        assert getattr(view, name.removeprefix("stage3_")) == default
    built = DeepSpeedZeroConfig(stage=2, prefetch_bucket_size=7, stage3_max_live_parameters=9)
    assert built.stage == ZeroStageEnum.gradients == 2 and built.prefetch_bucket_size == 7
    assert built.max_live_parameters == 9


def test_precision_views() -> None:
    fp16 = DeepSpeedFP16Config(enabled=True, initial_scale_power=8, loss_scale=0)
    assert fp16.enabled and fp16.initial_dynamic_scale() == 256 and fp16.loss_scale == 0
    assert fp16.auto_cast is False and fp16.fp16_master_weights_and_grads is False
    assert fp16.hysteresis == 2 and fp16.min_loss_scale == 1.0
    assert get_float16_config(RAW).loss_scale_window == 500
    bf16 = DeepSpeedBF16Config(enabled=True)
    assert bf16.enabled and not bf16.immediate_grad_update and bf16.check_grad_overflow
    assert not DeepSpeedBF16Config().enabled


@pytest.mark.parametrize("bad", [
    {"train_batch_size": 4, "zero_optimization": {"stage": 5}},
    {"train_batch_size": 4, "gradient_clipp1ng": 1.0},
    {"train_batch_size": 4, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
    {"train_batch_size": 4, "zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": True}},
    {"zero_optimization": {"stage": 1}},  # no batch size
])
def test_bad_configs_raise_deepspeeds_error(bad: dict) -> None:
    assert DeepSpeedConfigError is ConfigError and issubclass(DeepSpeedConfigError, ValueError)
    with pytest.raises(DeepSpeedConfigError):
        DeepSpeedConfig(bad)


def test_refused_fetch_by_all_reduce_says_why() -> None:
    with pytest.raises(ConfigError, match="all-gathers only"):
        load_config({"zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": True}})
    with pytest.raises(DeepSpeedConfigError):
        DeepSpeedZeroConfig(stage=7)


@pytest.mark.parametrize("type_name, torch_adam, on_host, built", [
    ("AdamW", True, False, torch.optim.AdamW), ("AdamW", True, True, torch.optim.AdamW),
    ("Adam", True, False, torch.optim.AdamW), ("AdamW", False, False, FusedAdam),
    ("Adam", False, False, FusedAdam), ("Adam", False, True, DeepSpeedCPUAdam),
])
def test_torch_adam_picks_the_class_deepspeed_builds(type_name: str, torch_adam: bool, on_host: bool,
                                                       built: type) -> None:
    from zeroshard.optim.builder import from_config

    config = load_config({"optimizer": {"type": type_name, "params": {"lr": 1e-3, "torch_adam": torch_adam}}})
    assert config.optimizer is not None
    opt = from_config(type_name, config.optimizer.params, [{"params": [torch.nn.Parameter(torch.zeros(2))]}],
                      on_host=on_host)
    assert type(opt) is built and opt.defaults["decoupled_weight_decay"] and opt.defaults["fused"]


def test_adam_w_mode_false_builds_adams_l2_penalty() -> None:
    from zeroshard.optim.builder import from_config

    for torch_adam, built in ((False, FusedAdam), (True, torch.optim.Adam)):
        params = {"adam_w_mode": False, "torch_adam": torch_adam}
        opt = from_config("Adam", params, [{"params": [torch.nn.Parameter(torch.zeros(2))]}])
        assert type(opt) is built and not opt.defaults["decoupled_weight_decay"]


def test_config_utils() -> None:
    assert get_scalar_param({"a": 1}, "a", 2) == 1 and get_scalar_param({}, "a", 2) == 2
    with pytest.raises(DeepSpeedConfigError, match="repeats"):
        json.loads('{"a": 1, "a": 2}', object_pairs_hook=dict_raise_error_on_duplicate_keys)
    text = json.dumps({"bucket": 5e8, "small": 3, "flag": True, "list": [1, 2000]}, cls=ScientificNotationEncoder)
    assert "5.000000e+08" in text and '"small": 3' in text and "true" in text and "2.000000e+03" in text
    assert json.loads(text)["bucket"] == 5e8


def test_zero3_linear_wrap_is_torchs_linear() -> None:
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    torch.testing.assert_close(zero3_linear_wrap(x, w, b), torch.nn.functional.linear(x, w, b))
    torch.testing.assert_close(zero3_linear_wrap(x, w), x @ w.T)


def test_zero_config_class_parses_the_block_alone_with_deepspeeds_forms() -> None:
    from zeroshard.deepspeed.runtime.zero.config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                         DeepSpeedZeroOffloadParamConfig)

    assert DeepSpeedZeroConfig().offload_param is None and DeepSpeedZeroConfig().offload_optimizer is None
    nulls = DeepSpeedZeroConfig(offload_param=None, offload_optimizer=None)
    assert nulls.offload_param is None and nulls.offload_optimizer is None
    given = DeepSpeedZeroConfig(offload_param={}, offload_optimizer={})
    assert isinstance(given.offload_param, DeepSpeedZeroOffloadParamConfig) and given.offload_param.device == "none"
    assert isinstance(given.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    # the deprecated switches are the blocks they stand for (stage 0 here: cross-block rules are the config's)
    assert DeepSpeedZeroConfig(cpu_offload_param=True).offload_param.device == "cpu"
    assert DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer.device == "cpu"
    assert DeepSpeedZeroOffloadParamConfig(device="cpu", pin_memory=True).pin_memory is True
    assert DeepSpeedZeroConfig(stage=1).pipeline_loading_checkpoint is False


def test_legacy_cpu_offload_switches_become_offload_blocks() -> None:
    zero = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}}).zero_optimization
    assert zero.offload_optimizer.device == "cpu"
    assert load_config({"zero_optimization": {"stage": 2, "cpu_offload": False}}).zero_optimization \
        .offload_optimizer.device == "none"
    with pytest.raises(ConfigError, match="old spelling of offload_optimizer"):
        load_config({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match="needs ZeRO stage 3"):  # the whole config's rule still holds
        load_config({"zero_optimization": {"stage": 2, "cpu_offload_param": True}})
    with pytest.raises(ConfigError, match="pipeline_loading_checkpoint"):
        load_config({"zero_optimization": {"stage": 3, "pipeline_loading_checkpoint": True}})


def test_leaf_module_block_reads_deepspeeds_forms() -> None:
    from zeroshard.deepspeed.runtime.zero.leaf_module_config import (DEFAULT_LEAF_MODULE_CLASSES,
                                                                     DeepSpeedZeroLeafModuleConfig)

    assert DeepSpeedZeroConfig().leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES
    leaf = DeepSpeedZeroConfig(leaf_module={"classes": "a.B", "names": ["x", "x", "y"], "name_suffixes": []})
    block = leaf.leaf_module
    assert (block.classes, block.names, block.name_suffixes) == (["a.B"], ["x", "y"], [])
    assert DeepSpeedZeroLeafModuleConfig(names="z").names == ["z"]
    with pytest.raises(ConfigError, match="a list of strings"):
        load_config({"zero_optimization": {"leaf_module": {"names": [1]}}})
    with pytest.raises(ConfigError, match="JSON array"):
        load_config({"zero_optimization": {"leaf_module": {"names": {"a": 1}}}})
