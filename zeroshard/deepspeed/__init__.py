"""zeroshard under DeepSpeed's names: every module path DeepSpeed scripts import, and the thin layer
that lets DeepSpeed scripts, Hugging Face and Accelerate drive zeroshard ([Note: one thin layer for
DeepSpeed's names] in deepspeed/engine_api.py).

[Note: DeepSpeed's module paths at zeroshard's root]
DeepSpeed's paths (``zero``, ``comm``, ``accelerator``, ``ops.adam``, ``runtime.zero.partition_parameters``,
...) live here, in one package, and are also answered at zeroshard's root, so ``import zeroshard as
deepspeed`` scripts, ``from zeroshard.zero import Init`` and ``install_as_deepspeed()`` (which maps
``deepspeed.x`` to ``zeroshard.x``) all reach them.  Each is registered in ``sys.modules`` under both
names, one module object under two names: a submodule imported by its root name is never executed a
second time, and a patch of a module attribute reaches the code that reads it.  A test checks that
every module of this package that is a DeepSpeed path is in :data:`DEEPSPEED_PATHS`.  DeepSpeed's
``sequence.layer`` is the exception: zeroshard's own sequence parallelism has DeepSpeed's folder name,
so ``zeroshard.sequence`` is the core's package, and ``deepspeed.sequence.layer`` reaches its
``layer.py`` (``DistributedAttention``) directly, with no module here to publish over it.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from . import engine_api  # noqa: F401  (registers DeepSpeed's accessors on every engine)

#: DeepSpeed's module paths, relative to ``deepspeed`` (and to ``zeroshard``)
DEEPSPEED_PATHS = ("accelerator", "checkpointing", "comm", "git_version_info", "module_inject",
                   "module_inject.tp_shard", "moe", "moe.layer", "moe.utils", "ops",
                   "ops.adam", "ops.op_builder", "pipe", "runtime", "runtime.activation_checkpointing",
                   "runtime.activation_checkpointing.checkpointing",
                   "runtime.activation_checkpointing.offload_activations", "runtime.bf16_optimizer",
                   "runtime.config", "runtime.config_utils",
                   "runtime.engine", "runtime.fp16", "runtime.fp16.fused_optimizer", "runtime.fp16.loss_scaler",
                   "runtime.fp16.unfused_optimizer", "runtime.lr_schedules", "runtime.pipe", "runtime.pipe.topology",
                   "runtime.precision_config", "runtime.sequence_parallel",
                   "runtime.sequence_parallel.parallel_state_sp", "runtime.sequence_parallel.ulysses_sp",
                   "runtime.utils",
                   "runtime.zero", "runtime.zero.config", "runtime.zero.leaf_module_config",
                   "runtime.zero.linear", "runtime.zero.muon", "runtime.zero.muon.muon_optimizer",
                   "runtime.zero.offload_config", "runtime.zero.partition_parameters",
                   "runtime.zero.stage3", "runtime.zero.stage_1_and_2", "runtime.zero.tiling",
                   "utils", "utils.groups", "utils.init_on_device", "utils.logging", "utils.pin_memory_tracker",
                   "utils.tensor_fragment", "utils.torch", "utils.z3_leaf_module", "utils.zero_to_fp32", "zero")


#: DeepSpeed paths that are another path's module under a second name, so no file of their own:
#: ``runtime.activation_checkpointing.checkpointing`` is ``checkpointing`` (as in DeepSpeed)
ALIASED_PATHS = ("runtime.activation_checkpointing.checkpointing",)


def publish_at_root(root: ModuleType) -> None:
    """Register every DeepSpeed path under ``zeroshard.<path>`` too (the root imports the top-level ones
    as attributes itself)."""
    for path in DEEPSPEED_PATHS:
        sys.modules[f"{root.__name__}.{path}"] = importlib.import_module(f"{__name__}.{path}")
