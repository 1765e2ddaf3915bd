"""zeroshard: ZeRO sharded data-parallel training for PyTorch.

    engine, optimizer, loader, scheduler = zeroshard.initialize(model=model, config="ds_config.json")
    loss = engine(batch).loss; engine.backward(loss); engine.step()

DeepSpeed scripts run with ``import zeroshard as deepspeed``: the names and module paths they use
(``zero``, ``comm``, ``accelerator``, ``ops.adam``, ``utils``, ``checkpointing``, ``runtime``, ...) are
here, over zeroshard's own machinery (see zeroshard/deepspeed/).
"""

import sys

from .api import initialize
from .deepspeed.arguments import add_config_arguments
from .deepspeed.comm import init_distributed
from .deepspeed.install import install_as_deepspeed
from .config import ConfigError, ZeroshardConfig, load_config
from .distributed.collectives import CollectiveError
from .distributed.world import World
from .engine.engine import Engine
from .engine.engine import Engine as DeepSpeedEngine
from .sharding.stage3.gathered import GatheredParameters
from .sharding.stage3.init_context import Init
from .planning import model_state_bytes
from .optim.nonfinite import NonFiniteGradientError
from .checkpoint.pretrained import PretrainedError, load_pretrained
from .sharding.stage3.placeholder import ShardedParameterError
from .tensor_parallel import tp_model_init
from .version import __version__

from .deepspeed import (accelerator, checkpointing, comm, git_version_info, module_inject, moe, ops, pipe,
                        publish_at_root, runtime, utils, zero)

from .deepspeed.utils import OnDevice

publish_at_root(sys.modules[__name__])

#: DeepSpeed's version parts and build identity at its root, answered with zeroshard's
__version_major__, __version_minor__, __version_patch__ = (int(part) for part in __version__.split(".")[:3])
__git_hash__, __git_branch__ = git_version_info.git_hash, git_version_info.git_branch

__all__ = ["initialize", "Engine", "GatheredParameters", "Init", "init_distributed", "World", "load_config",
           "ZeroshardConfig", "ConfigError", "CollectiveError", "model_state_bytes", "__version__",
           "add_config_arguments", "DeepSpeedEngine", "zero", "comm", "accelerator", "ops", "utils",
           "checkpointing", "runtime", "module_inject", "moe", "pipe", "git_version_info", "NonFiniteGradientError",
           "install_as_deepspeed", "OnDevice",
           "load_pretrained", "PretrainedError", "ShardedParameterError", "tp_model_init"]



