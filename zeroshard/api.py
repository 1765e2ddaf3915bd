"""``zeroshard.initialize()``: the DeepSpeed-compatible entry point."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import Dataset

from .config import ZeroshardConfig, load_config, resolve_batch_sizes
from .data import DistributedLoader, build_loader
from .distributed.world import init_distributed
from .engine import Engine, SchedulerSpec


def initialize(model: nn.Module, model_parameters: Any = None, config: Any = None, optimizer: Any = None,
               lr_scheduler: SchedulerSpec = None, training_data: Optional[Dataset] = None,
               collate_fn: Optional[Callable[..., Any]] = None, args: Any = None,
               config_params: Any = None) -> tuple[Engine, torch.optim.Optimizer, Optional[DistributedLoader], Any]:
    """Wrap ``model`` for ZeRO training; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    ``config`` is a path to a DeepSpeed-style JSON file or a dict (``config_params`` and
    ``args.deepspeed_config`` are accepted as DeepSpeed's older spellings).  ``optimizer`` and
    ``lr_scheduler`` may be objects or callables; ``training_data`` gives back a distributed loader at
    the micro batch size.  Joins the process group (torchrun's env://) if nobody has yet.
    """
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None) or getattr(args, "zeroshard_config", None)
    parsed: ZeroshardConfig = load_config(source)
    world = init_distributed(timeout_s=parsed.collective_timeout)
    parsed = resolve_batch_sizes(parsed, world.world_size)
    if parsed.seed is not None:
        torch.manual_seed(parsed.seed)
    engine = Engine(model, parsed, world, model_parameters, optimizer, lr_scheduler)
    loader = None
    if training_data is not None:
        loader = build_loader(training_data, engine.train_micro_batch_size_per_gpu(), world, collate_fn,
                              seed=parsed.seed or 0)
        engine.data_loader = loader
    return engine, engine.optimizer, loader, engine.lr_scheduler
