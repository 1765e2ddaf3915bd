"""zeroshard: ZeRO sharded data-parallel training for PyTorch.

    engine, optimizer, loader, scheduler = zeroshard.initialize(model=model, config="ds_config.json")
    loss = engine(batch).loss; engine.backward(loss); engine.step()
"""

from .api import initialize
from .config import ConfigError, ZeroshardConfig, load_config
from .distributed.collectives import CollectiveError
from .distributed.world import World, init_distributed
from .engine import Engine
from .gathered import GatheredParameters
from .init_context import Init
from .memory import model_state_bytes
from .version import __version__

__all__ = ["initialize", "Engine", "GatheredParameters", "Init", "init_distributed", "World", "load_config", "ZeroshardConfig",
           "ConfigError", "CollectiveError", "model_state_bytes", "__version__"]
