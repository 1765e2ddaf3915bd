"""The lr each optimizer step uses equals DeepSpeed's, step for step (values worked out by hand from
DeepSpeed's formulas: its schedule starts at iteration -1 and is stepped after each optimizer step)."""

import math

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.optim.schedulers import build_scheduler


def lrs_used(type_name: str, params: dict, steps: int, base_lr: float = 1.0, betas: bool = False) -> list:
    optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=base_lr)
    scheduler = build_scheduler(type_name, params, optimizer)
    used = []
    for _ in range(steps):
        group = optimizer.param_groups[0]
        used.append(round(group["betas"][0], 6) if betas else round(group["lr"], 6))
        scheduler.step()
    return used


@pytest.mark.parametrize("type_name, params, expected", [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 4},
     [0.0, 0.0, 0.5, round(math.log(3) / math.log(4), 6), 1.0, 1.0]),
    ("WarmupLR", {"warmup_min_lr": 0.2, "warmup_max_lr": 1.0, "warmup_num_steps": 4, "warmup_type": "linear"},
     [0.2, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0]),
    ("WarmupLR", {"warmup_num_steps": 2, "warmup_type": "linear"}, [0.0, 0.0, 0.5, 1.0]),  # max: the optimizer's lr
    ("WarmupDecayLR", {"total_num_steps": 8, "warmup_num_steps": 4, "warmup_max_lr": 1.0, "warmup_type": "linear"},
     [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]),
    ("WarmupCosineLR", {"total_num_steps": 8, "warmup_num_steps": 4, "cos_min_ratio": 0.0, "warmup_type": "linear"},
     [0.0, 0.0, 0.5, 1.0, 1.5, round(1 + math.cos(math.pi / 4), 6), 1.0, round(1 + math.cos(3 * math.pi / 4), 6),
      0.0, 0.0]),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.1, "lr_range_test_step_size": 2}, [0.1, 0.15, 0.2, 0.25]),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.1, "lr_range_test_step_size": 2, "lr_range_test_staircase": True},
     [0.1, 0.1, 0.2, 0.2, 0.3]),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 2, "decay_lr_rate": 0.5,
                  "decay_step_size": 2}, [0.1, 0.55, 1.0, 0.55, 0.1, 0.08, 0.066667]),
])
def test_lr_used_by_each_optimizer_step(type_name, params, expected) -> None:
    assert lrs_used(type_name, params, len(expected), base_lr=2.0 if type_name == "WarmupCosineLR" else 1.0) \
        == expected


def test_one_cycle_moves_beta1_inversely() -> None:
    params = {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 2}
    assert lrs_used("OneCycle", params, 6, betas=True) == [0.8, 0.85, 0.8, 0.85, 0.9, 0.9]


def test_the_engine_steps_with_deepspeeds_lr() -> None:
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1.0}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.2, "warmup_max_lr": 1.0,
                                                           "warmup_num_steps": 4, "warmup_type": "linear"}}}
    engine, *_ = zeroshard.initialize(model=nn.Linear(2, 1), config=config)
    used = []
    for _ in range(6):
        used.append(round(engine.get_lr()[0], 6))
        engine.backward(engine(torch.ones(1, 2)).sum())
        engine.step()
    assert used == [0.2, 0.2, 0.4, 0.6, 0.8, 1.0]
