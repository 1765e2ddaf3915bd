"""Every name users import from zeroshard imports, at the path they use.

The list is the public surface: ``zeroshard.__all__``, DeepSpeed's module paths at zeroshard's root (what
``import zeroshard as deepspeed`` scripts and ``install_as_deepspeed()`` reach), the names the docs
import, and zeroshard's own documented modules.  A regrouping of the package that breaks one fails here.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import zeroshard
from zeroshard.deepspeed import ALIASED_PATHS, DEEPSPEED_PATHS

ROOT = Path(__file__).resolve().parents[2]

#: module path -> names imported from it (DeepSpeed's paths, as DeepSpeed scripts and Hugging Face use them)
PUBLIC = {
    "zeroshard": ["initialize", "Init", "GatheredParameters", "install_as_deepspeed", "init_distributed",
                  "add_config_arguments", "DeepSpeedEngine", "Engine", "World", "load_config", "ZeroshardConfig",
                  "ConfigError", "CollectiveError", "NonFiniteGradientError", "ShardedParameterError",
                  "load_pretrained", "PretrainedError", "model_state_bytes", "__version__", "zero", "comm",
                  "accelerator", "ops", "utils", "checkpointing", "runtime", "moe", "pipe", "git_version_info"],
    "zeroshard.zero": ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
                       "unregister_external_parameter"],
    "zeroshard.comm": ["init_distributed", "is_initialized", "get_rank", "get_world_size", "get_local_rank",
                       "barrier", "all_reduce"],
    "zeroshard.accelerator": ["get_accelerator", "CPUAccelerator", "CUDAAccelerator", "is_current_accelerator_supported",
                              "SUPPORTED_ACCELERATOR_LIST"],
    "zeroshard.git_version_info": ["version", "git_hash", "git_branch", "installed_ops", "accelerator_name",
                                   "torch_info"],
    "zeroshard.ops": ["adam", "op_builder", "__compatible_ops__"],
    "zeroshard.ops.adam": ["FusedAdam", "DeepSpeedCPUAdam"],
    "zeroshard.ops.op_builder": ["OpBuilder", "OpNotBuiltError", "ALL_OPS", "CPUAdamBuilder", "CPUAdagradBuilder",
                                 "CPULionBuilder", "FusedAdamBuilder", "FusedLambBuilder", "FusedLionBuilder",
                                 "AsyncIOBuilder", "GDSBuilder", "PinMemoryBuilder", "UtilsBuilder",
                                 "TransformerBuilder", "InferenceBuilder", "QuantizerBuilder", "FPQuantizerBuilder",
                                 "EvoformerAttnBuilder", "NotImplementedBuilder"],
    "zeroshard.utils": ["logger", "log_dist", "RepeatingLoader", "set_random_seed", "zero_to_fp32", "torch",
                        "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
                        "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_set_full_grad",
                        "safe_update_full_grad_vectorized", "safe_get_local_fp32_param", "safe_get_local_grad",
                        "safe_get_local_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
                        "safe_set_local_optimizer_state", "set_z3_leaf_modules", "unset_z3_leaf_modules",
                        "get_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter", "set_z3_leaf_module",
                        "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix"],
    "zeroshard.utils.tensor_fragment": ["safe_get_full_fp32_param", "safe_set_full_fp32_param",
                                        "safe_get_local_fp32_param", "GradientsUnavailableError"],
    "zeroshard.utils.torch": ["required_torch_version"],
    "zeroshard.utils.z3_leaf_module": ["set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules",
                                       "z3_leaf_module", "z3_leaf_parameter"],
    "zeroshard.utils.zero_to_fp32": ["get_fp32_state_dict_from_zero_checkpoint",
                                     "load_state_dict_from_zero_checkpoint",
                                     "convert_zero_checkpoint_to_fp32_state_dict"],
    "zeroshard.checkpointing": ["checkpoint", "checkpoint_modules", "configure", "is_configured", "reset"],
    "zeroshard.runtime.engine": ["DeepSpeedEngine"],
    "zeroshard.runtime.lr_schedules": ["VALID_LR_SCHEDULES", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                                       "OneCycle", "LRRangeTest", "LR_SCHEDULE", "LR_RANGE_TEST", "ONE_CYCLE",
                                       "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR", "LR_RANGE_TEST_MIN_LR",
                                       "LR_RANGE_TEST_STEP_RATE", "LR_RANGE_TEST_STEP_SIZE", "LR_RANGE_TEST_STAIRCASE",
                                       "EDGE_VALUE", "MID_VALUE", "CYCLE_FIRST_STEP_SIZE", "CYCLE_FIRST_STAIR_COUNT",
                                       "CYCLE_SECOND_STEP_SIZE", "CYCLE_SECOND_STAIR_COUNT", "DECAY_STEP_SIZE",
                                       "CYCLE_MIN_LR", "CYCLE_MAX_LR", "DECAY_LR_RATE", "CYCLE_MIN_MOM", "CYCLE_MAX_MOM",
                                       "DECAY_MOM_RATE", "WARMUP_MIN_LR", "WARMUP_MAX_LR", "WARMUP_NUM_STEPS",
                                       "WARMUP_TYPE", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE", "WARMUP_MIN_RATIO",
                                       "COS_MIN_RATIO", "TOTAL_NUM_STEPS", "add_tuning_arguments", "parse_arguments",
                                       "override_params", "get_config_from_args", "get_lr_from_config", "update_lr",
                                       "get_torch_optimizer"],
    "zeroshard.runtime.utils": ["set_random_seed"],
    "zeroshard.runtime.zero": ["Init", "GatheredParameters", "ZeroParamStatus", "partition_parameters"],
    "zeroshard.runtime.zero.partition_parameters": ["Init", "GatheredParameters", "ZeroParamStatus"],
    "zeroshard.runtime.config": ["DeepSpeedConfig", "DeepSpeedConfigError"],
    "zeroshard.runtime.config_utils": ["get_scalar_param", "get_list_param", "get_dict_param",
                                       "dict_raise_error_on_duplicate_keys", "ScientificNotationEncoder"],
    "zeroshard.runtime.precision_config": ["DeepSpeedFP16Config", "DeepSpeedBF16Config", "get_float16_config",
                                           "get_bfloat16_config"],
    "zeroshard.runtime.zero.config": ["DeepSpeedZeroConfig", "ZeroStageEnum"],
    "zeroshard.runtime.zero.linear": ["zero3_linear_wrap"],
    "zeroshard.runtime.zero.tiling": ["TiledLinear", "TiledLinearReturnBias"],
    "zeroshard.runtime.activation_checkpointing.offload_activations": [
        "CheckpointHiddenStatesOffload", "get_checkpoint_hidden_states_offloading_ctx_manager"],
    "zeroshard.utils.pin_memory_tracker": ["track_pinned_memory", "pinned_memory_summary"],
    "zeroshard.utils.init_on_device": ["OnDevice"],
    "zeroshard.moe.layer": ["MoE"],
    "zeroshard.moe.utils": ["split_params_into_different_moe_groups_for_optimizer", "is_moe_param"],
    "zeroshard.experts": ["MoE", "MoENotSupported", "TopKGate", "is_expert_param"],
    "zeroshard.pipe": ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipeDataParallelTopology"],
    "zeroshard.pipeline": ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipeDataParallelTopology",
                           "PipelineEngine", "PipeSchedule", "OneFOneB", "GPipe", "ParallelDims",
                           "PipelineBatchSizeError", "PipelineConfigError", "PipelineUsageError",
                           "StagesDoNotDivideError", "TooFewLayersError", "PartitionMethodError"],
    "zeroshard.distributed.parallel_dims": ["ParallelDims", "ParallelGroups", "StagesDoNotDivideError"],
    # zeroshard's own documented modules
    "zeroshard.config": ["describe_keys", "load_config", "ConfigError"],
    "zeroshard.checkpoint": ["consolidate", "describe", "CheckpointReader", "CheckpointError"],
    "zeroshard.planning": ["model_state_bytes", "estimate_all", "scale_estimates"],
    "zeroshard.engine": ["Engine", "ModelChangedError"],
    "zeroshard.sequence": ["DistributedAttention", "SequenceParallelError"],
    "zeroshard.tools.testing": ["run_world"],
    "zeroshard.tools.demo.model": ["GPT", "GPTConfig", "demo_gpt"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_import(module: str) -> None:
    imported = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lacks {missing}"


def test_root_answers_every_deepspeed_path_with_the_same_module() -> None:
    """``zeroshard.<path>`` is the very module ``zeroshard.deepspeed.<path>``: one object, never run twice."""
    for path in DEEPSPEED_PATHS:
        assert importlib.import_module(f"zeroshard.{path}") is importlib.import_module(f"zeroshard.deepspeed.{path}")
    shipped = {str(p.relative_to(ROOT / "zeroshard" / "deepspeed").with_suffix("")).replace("/", ".")
               .removesuffix(".__init__") for p in (ROOT / "zeroshard" / "deepspeed").rglob("*.py")}
    glue = {"__init__", "arguments", "bootstrap", "engine_api", "install", "launcher", "param_fragments", "refused"}
    assert shipped - glue == set(DEEPSPEED_PATHS) - set(ALIASED_PATHS), \
        "a DeepSpeed path under zeroshard/deepspeed/ is not published"
    assert set(zeroshard.__all__) >= {p for p in DEEPSPEED_PATHS if "." not in p}


def test_names_the_docs_import_resolve() -> None:
    """Every ``from zeroshard... import ...`` and dotted ``zeroshard.x.y`` in README.md and docs/ resolves."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    checked = 0
    for path in texts:
        text = path.read_text()
        for module, names in re.findall(r"from (zeroshard[\w.]*) import ([\w, ]+)", text):
            imported = importlib.import_module(module)
            for name in (n.strip() for n in names.split(",")):
                assert hasattr(imported, name), f"{path.name}: {module} has no {name}"
                checked += 1
        for dotted in re.findall(r"(?<![\w./])zeroshard(?:\.\w+)+", text):
            parts = dotted.split(".")
            target = None
            for cut in range(len(parts), 0, -1):
                try:
                    target = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                for attribute in parts[cut:]:
                    target = getattr(target, attribute, None)
                break
            assert target is not None, f"{path.name} names {dotted}, which does not resolve"
            checked += 1
    assert checked > 5


def test_deepspeed_submodules_resolve_once_under_install_as_deepspeed() -> None:
    """Under ``install_as_deepspeed()``, ``deepspeed.x.y`` is zeroshard's module for every DeepSpeed path."""
    code = ("import importlib, zeroshard; zeroshard.install_as_deepspeed()\n"
            "from zeroshard.deepspeed import DEEPSPEED_PATHS\n"
            "for p in DEEPSPEED_PATHS:\n"
            "    assert importlib.import_module('deepspeed.' + p) is importlib.import_module('zeroshard.deepspeed.' + p), p\n"
            "import deepspeed; assert deepspeed is zeroshard\n"
            "from deepspeed.sequence.layer import DistributedAttention\n"
            "assert DistributedAttention is zeroshard.sequence.DistributedAttention\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
