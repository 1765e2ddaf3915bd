"""``zeroshard.deepspeed.runtime.lr_schedules``: DeepSpeed's schedule classes and ``VALID_LR_SCHEDULES``,
the names of the schedules and of their parameters as constants (the strings a config's ``scheduler``
block uses), and the helpers that build such a block from command-line flags.

The flags are the parameter names: ``--warmup_num_steps 100`` sets ``params["warmup_num_steps"]``, and
``--lr_schedule`` picks the schedule whose parameters :func:`get_config_from_args` collects.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

import torch
from torch.optim import Optimizer

from ...optim.schedulers import VALID_LR_SCHEDULES, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["VALID_LR_SCHEDULES", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest",
           "LR_SCHEDULE", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR",
           "LR_RANGE_TEST_MIN_LR", "LR_RANGE_TEST_STEP_RATE", "LR_RANGE_TEST_STEP_SIZE", "LR_RANGE_TEST_STAIRCASE",
           "EDGE_VALUE", "MID_VALUE", "CYCLE_FIRST_STEP_SIZE", "CYCLE_FIRST_STAIR_COUNT", "CYCLE_SECOND_STEP_SIZE",
           "CYCLE_SECOND_STAIR_COUNT", "DECAY_STEP_SIZE", "CYCLE_MIN_LR", "CYCLE_MAX_LR", "DECAY_LR_RATE",
           "CYCLE_MIN_MOM", "CYCLE_MAX_MOM", "DECAY_MOM_RATE", "WARMUP_MIN_LR", "WARMUP_MAX_LR", "WARMUP_NUM_STEPS",
           "WARMUP_TYPE", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE", "WARMUP_MIN_RATIO", "COS_MIN_RATIO",
           "TOTAL_NUM_STEPS", "add_tuning_arguments", "parse_arguments", "override_params", "get_config_from_args",
           "get_lr_from_config", "update_lr", "get_torch_optimizer"]

# the flag that names the schedule, and the schedules' names (a config's scheduler.type)
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"

# LRRangeTest's parameters
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"

# OneCycle's parameters
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"

# WarmupLR's, WarmupDecayLR's and WarmupCosineLR's parameters, and the two warmup curves
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

#: per schedule, the flags :func:`add_tuning_arguments` declares for it: name -> (type, default)
_FLAGS: dict[str, dict[str, tuple[Any, Any]]] = {
    LR_RANGE_TEST: {LR_RANGE_TEST_MIN_LR: (float, 0.001), LR_RANGE_TEST_STEP_RATE: (float, 1.0),
                    LR_RANGE_TEST_STEP_SIZE: (int, 1000), LR_RANGE_TEST_STAIRCASE: (bool, False)},
    ONE_CYCLE: {CYCLE_FIRST_STEP_SIZE: (int, 1000), CYCLE_FIRST_STAIR_COUNT: (int, -1),
                CYCLE_SECOND_STEP_SIZE: (int, -1), CYCLE_SECOND_STAIR_COUNT: (int, -1), DECAY_STEP_SIZE: (int, 1000),
                CYCLE_MIN_LR: (float, 0.01), CYCLE_MAX_LR: (float, 0.1), DECAY_LR_RATE: (float, 0.0),
                CYCLE_MIN_MOM: (float, 0.8), CYCLE_MAX_MOM: (float, 0.9), DECAY_MOM_RATE: (float, 0.0)},
    WARMUP_LR: {WARMUP_MIN_LR: (float, 0.0), WARMUP_MAX_LR: (float, 0.001), WARMUP_NUM_STEPS: (int, 1000),
                WARMUP_TYPE: (str, WARMUP_LOG_RATE)},
    WARMUP_COSINE_LR: {WARMUP_NUM_STEPS: (int, 1000), WARMUP_TYPE: (str, WARMUP_LOG_RATE),
                       WARMUP_MIN_RATIO: (float, 0.01), COS_MIN_RATIO: (float, 0.01)},
}
_FLAGS[WARMUP_DECAY_LR] = _FLAGS[WARMUP_LR]


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``--lr_schedule`` and every schedule parameter as a flag of its own name (plus
    ``--cycle_momentum``, which OneCycle takes from its config block instead)."""
    group = parser.add_argument_group("Convergence Tuning", "learning-rate schedule flags (zeroshard)")
    group.add_argument(f"--{LR_SCHEDULE}", type=str, default=None, help=f"one of {VALID_LR_SCHEDULES}")
    declared: set[str] = set()
    for schedule, flags in _FLAGS.items():
        for name, (kind, default) in flags.items():
            if name in declared:
                continue
            declared.add(name)
            if kind is bool:
                group.add_argument(f"--{name}", default=default, action="store_true", help=f"{schedule}: {name}")
            else:
                group.add_argument(f"--{name}", type=kind, default=default, help=f"{schedule}: {name}")
    group.add_argument("--cycle_momentum", default=False, action="store_true", help=f"{ONE_CYCLE}: cycle_momentum")
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    """This process's command line, read for the tuning flags only: (their values, the other arguments)."""
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def override_params(args: argparse.Namespace, params: dict[str, Any]) -> None:
    """Copy into ``params`` every schedule parameter ``args`` sets (not None)."""
    for flags in _FLAGS.values():
        for name in flags:
            if getattr(args, name, None) is not None:
                params[name] = getattr(args, name)


def get_config_from_args(args: argparse.Namespace) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """A ``scheduler`` config block from ``--lr_schedule`` and its parameters' flags, or (None, why not)."""
    schedule = getattr(args, LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{LR_SCHEDULE} was not given"
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not one of the schedules {VALID_LR_SCHEDULES}"
    params = {name: getattr(args, name) for name in _FLAGS[schedule] if getattr(args, name, None) is not None}
    return {"type": schedule, "params": params}, None


#: the parameter that is the peak learning rate of each schedule (WarmupCosineLR has none: it scales)
_PEAK_LR = {LR_RANGE_TEST: LR_RANGE_TEST_MIN_LR, ONE_CYCLE: CYCLE_MAX_LR, WARMUP_LR: WARMUP_MAX_LR,
            WARMUP_DECAY_LR: WARMUP_MAX_LR}


def get_lr_from_config(config: dict[str, Any]) -> tuple[Optional[float], str]:
    """The learning rate a ``scheduler`` block sets (LRRangeTest: where it starts; the others: their
    peak), or (None, why not)."""
    if "type" not in config or "params" not in config:
        return None, "the scheduler block needs 'type' and 'params'"
    schedule = config["type"]
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not one of the schedules {VALID_LR_SCHEDULES}"
    if schedule not in _PEAK_LR:
        return None, f"{schedule} scales each group's own learning rate: its parameters set none"
    return config["params"][_PEAK_LR[schedule]], ""


def update_lr(param_groups: list[dict[str, Any]], lrs: list[Any]) -> list[Any]:
    """Set each group's learning rate (in place where it is a tensor); returns them."""
    for group, lr in zip(param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr.squeeze() if isinstance(lr, torch.Tensor) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def get_torch_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer itself, or the one a wrapper holds as ``.optimizer``."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer and holds none as .optimizer")
