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
from zeroshard.deepspeed import DEEPSPEED_PATHS

ROOT = Path(__file__).resolve().parents[2]

#: module path -> names imported from it (DeepSpeed's paths, as DeepSpeed scripts and Hugging Face use them)
PUBLIC = {
    "zeroshard": ["initialize", "Init", "GatheredParameters", "install_as_deepspeed", "init_distributed",
                  "add_config_arguments", "DeepSpeedEngine", "Engine", "World", "load_config", "ZeroshardConfig",
                  "ConfigError", "CollectiveError", "NonFiniteGradientError", "ShardedParameterError",
                  "load_pretrained", "PretrainedError", "model_state_bytes", "__version__", "zero", "comm",
                  "accelerator", "ops", "utils", "checkpointing", "runtime", "moe", "pipe"],
    "zeroshard.zero": ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
                       "unregister_external_parameter"],
    "zeroshard.comm": ["init_distributed", "is_initialized", "get_rank", "get_world_size", "get_local_rank",
                       "barrier", "all_reduce"],
    "zeroshard.accelerator": ["get_accelerator", "CPUAccelerator", "CUDAAccelerator"],
    "zeroshard.ops.adam": ["FusedAdam", "DeepSpeedCPUAdam"],
    "zeroshard.utils": ["logger", "log_dist", "RepeatingLoader", "set_random_seed", "zero_to_fp32"],
    "zeroshard.utils.zero_to_fp32": ["get_fp32_state_dict_from_zero_checkpoint",
                                     "load_state_dict_from_zero_checkpoint",
                                     "convert_zero_checkpoint_to_fp32_state_dict"],
    "zeroshard.checkpointing": ["checkpoint", "checkpoint_modules", "configure", "is_configured", "reset"],
    "zeroshard.runtime.engine": ["DeepSpeedEngine"],
    "zeroshard.runtime.lr_schedules": ["VALID_LR_SCHEDULES", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                                       "OneCycle", "LRRangeTest"],
    "zeroshard.runtime.utils": ["set_random_seed"],
    "zeroshard.runtime.zero": ["Init", "GatheredParameters", "ZeroParamStatus", "partition_parameters"],
    "zeroshard.runtime.zero.partition_parameters": ["Init", "GatheredParameters", "ZeroParamStatus"],
    "zeroshard.moe.layer": ["MoE"],
    "zeroshard.moe.utils": ["split_params_into_different_moe_groups_for_optimizer"],
    "zeroshard.pipe": ["PipelineModule", "LayerSpec", "TiedLayerSpec"],
    # zeroshard's own documented modules
    "zeroshard.config": ["describe_keys", "load_config", "ConfigError"],
    "zeroshard.checkpoint": ["consolidate", "describe", "CheckpointReader", "CheckpointError"],
    "zeroshard.planning": ["model_state_bytes", "estimate_all", "scale_estimates"],
    "zeroshard.engine": ["Engine", "ModelChangedError"],
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
    glue = {"__init__", "arguments", "bootstrap", "engine_api", "install", "launcher", "refused"}
    assert shipped - glue == set(DEEPSPEED_PATHS), "a DeepSpeed path under zeroshard/deepspeed/ is not published"
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
            "import deepspeed; assert deepspeed is zeroshard\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
