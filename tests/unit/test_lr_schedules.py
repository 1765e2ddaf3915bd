"""The lr each optimizer step uses equals DeepSpeed's, step for step, and the schedules answer DeepSpeed's
calls (``step(n)``, ``get_mom``, ``get_lr_ratio``, argument checks) as DeepSpeed's do.  The values are
worked out by hand from DeepSpeed's formulas: its schedule starts at iteration -1, is stepped after each
optimizer step, and ``step(n)`` moves it to iteration ``n``."""

import math

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.optim.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler


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


# ------------------------------------------------------------- DeepSpeed's scheduler API, call by call
def adam(*lrs: float) -> torch.optim.Optimizer:
    return torch.optim.Adam([{"params": [nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs], betas=(0.9, 0.999))


def group_lrs(optimizer: torch.optim.Optimizer) -> list:
    return [float(g["lr"]) for g in optimizer.param_groups]


def test_step_with_an_iteration_jumps_to_it() -> None:
    # step(n) is DeepSpeed's iteration n: WarmupLR's log warmup over 10 gives 0.1 * log(2) / log(10) at 1
    optimizer = adam(0.1)
    scheduler = WarmupLR(optimizer, warmup_num_steps=10)
    assert group_lrs(optimizer) == [0.0] and scheduler.state_dict() == {"last_batch_iteration": -1}
    scheduler.step(1)
    assert scheduler.get_lr() == pytest.approx([0.0301029995664])
    assert group_lrs(optimizer) == pytest.approx([0.0301029995664])
    assert scheduler.get_last_lr() == pytest.approx([0.0301029995664])
    scheduler.step()  # the next iteration: 2
    assert scheduler.get_lr() == pytest.approx([0.0477121254720])  # 0.1 * log(3) / log(10)
    scheduler.step(10)
    assert scheduler.get_lr() == pytest.approx([0.1])
    assert scheduler.state_dict() == {"last_batch_iteration": 10}


@pytest.mark.parametrize("make, at_1, at_5", [
    (lambda o: WarmupDecayLR(o, total_num_steps=8, warmup_num_steps=4, warmup_max_lr=1.0, warmup_type="linear"),
     0.25, 0.75),                              # 1 / 4, then (8 - 5) / (8 - 4)
    (lambda o: WarmupCosineLR(o, total_num_steps=8, warmup_num_steps=4, cos_min_ratio=0.0, warmup_type="linear"),
     0.25, 0.5),                               # 1 / 4 of lr 1, then (1 + cos(pi * 2 / 4)) / 2
    (lambda o: LRRangeTest(o, lr_range_test_min_lr=0.1, lr_range_test_step_size=2), 0.2, 0.4),  # 0.1 * (1 + i' / 2)
    (lambda o: OneCycle(o, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=4), 0.55, 0.55),
])
def test_each_schedule_steps_to_deepspeeds_iteration(make, at_1, at_5) -> None:
    optimizer = adam(1.0)
    scheduler = make(optimizer)
    scheduler.step(1)
    assert group_lrs(optimizer) == pytest.approx([at_1])
    scheduler.step(5)
    assert group_lrs(optimizer) == pytest.approx([at_5])


@pytest.mark.parametrize("shape", [(), (1,)])
def test_a_tensor_lr_is_filled_in_place(shape) -> None:
    lr = torch.full(shape, 0.1, dtype=torch.float64)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = WarmupLR(optimizer, warmup_num_steps=10)
    assert optimizer.param_groups[0]["lr"] is lr and float(lr) == 0.0
    scheduler.step(1)
    assert optimizer.param_groups[0]["lr"] is lr and lr.shape == shape and lr.dtype == torch.float64
    assert float(lr) == pytest.approx(0.0301029995664)


def test_an_unknown_warmup_type_is_log() -> None:
    for make in (lambda o: WarmupLR(o, warmup_num_steps=10, warmup_type="cubic"),
                 lambda o: WarmupDecayLR(o, total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=10,
                                         warmup_type="cubic"),
                 lambda o: WarmupCosineLR(o, total_num_steps=20, warmup_num_steps=10, warmup_type="cubic")):
        optimizer = adam(0.1)
        scheduler = make(optimizer)
        assert scheduler.warmup_type == "log"
        scheduler.step(1)
        assert group_lrs(optimizer) == pytest.approx([0.0301029995664])


@pytest.mark.parametrize("make", [
    lambda o: WarmupLR(o, warmup_num_steps=None), lambda o: WarmupLR(o, warmup_num_steps=-5),
    lambda o: WarmupLR(o, warmup_num_steps=0), lambda o: WarmupDecayLR(o, 100, warmup_num_steps=None),
    lambda o: WarmupCosineLR(o, 100, warmup_num_steps=-5),
    lambda o: LRRangeTest(o, lr_range_test_step_size=0), lambda o: LRRangeTest(o, lr_range_test_step_size=-5),
    lambda o: OneCycle(o, 0.01, 0.1, cycle_first_step_size=0),
    lambda o: OneCycle(o, 0.01, 0.1, cycle_first_step_size=0, cycle_second_step_size=100),
    lambda o: OneCycle(o, 0.01, 0.1, cycle_first_step_size=100, cycle_second_step_size=-1),
    lambda o: WarmupLR(o, warmup_max_lr=[0.1, 0.2, 0.3]),
    lambda o: OneCycle(o, [0.01, 0.02, 0.03], 0.1), lambda o: OneCycle(o, 0.01, [0.1, 0.2, 0.3]),
    lambda o: OneCycle(o, 0.01, 0.1, cycle_min_mom=[0.8]), lambda o: OneCycle(o, 0.01, 0.1, cycle_max_mom=[0.9] * 3),
])
def test_bad_arguments_are_value_errors(make) -> None:
    with pytest.raises(ValueError):
        make(adam(0.1, 0.2))


def test_warmup_attributes_are_deepspeeds() -> None:
    scheduler = WarmupLR(adam(0.1, 0.2), warmup_num_steps=1)
    assert scheduler.max_lrs == [0.1, 0.2] and scheduler.min_lrs == [0.0, 0.0]
    assert scheduler.warmup_num_steps == 2  # at least 2
    scheduler.step(2)
    assert scheduler.get_lr() == pytest.approx([0.1, 0.2])  # each group warms up to its own lr
    cosine = WarmupCosineLR(adam(0.1, 0.2), total_num_steps=20, warmup_num_steps=10, warmup_min_ratio=0.5)
    assert cosine.warmup_num_steps == 10 and cosine.get_lr_ratio() == 0.0 and cosine.get_lr() == [0.0, 0.0]
    cosine.step(5)
    ratio = 0.5 + 0.5 * math.log(6) / math.log(10)
    assert cosine.get_lr_ratio() == pytest.approx(ratio) and cosine.get_lr() == pytest.approx([0.1 * ratio, 0.2 * ratio])
    cosine.step(14)  # progress (14 - 10 + 1) / 10
    assert cosine.get_lr_ratio() == pytest.approx(1e-4 + (1 - 1e-4) * (1 + math.cos(math.pi / 2)) / 2)
    cosine.step(40)  # past the end: the floor
    assert cosine.get_lr_ratio() == pytest.approx(1e-4)


def test_one_cycle_per_group_lrs_and_momentum() -> None:
    optimizer = adam(0.1, 0.2)
    scheduler = OneCycle(optimizer, cycle_min_lr=[0.001, 0.002], cycle_max_lr=[0.01, 0.02], cycle_min_mom=[0.8, 0.85],
                         cycle_max_mom=[0.9, 0.95], cycle_first_step_size=5, cycle_second_step_size=5)
    assert scheduler.step_ratio == 0.5
    # the optimizer starts at the bottom of both ranges; get_mom() is the formula's value at -1: the top
    assert group_lrs(optimizer) == pytest.approx([0.001, 0.002])
    assert [g["betas"] for g in optimizer.param_groups] == [(0.8, 0.99), (0.85, 0.99)]
    assert [m[0] for m in scheduler.get_mom()] == pytest.approx([0.9, 0.95])
    scheduler.step(2)  # scale 3 / 5
    assert group_lrs(optimizer) == pytest.approx([0.0064, 0.0128])
    assert [g["betas"][0] for g in optimizer.param_groups] == pytest.approx([0.84, 0.89])
    scheduler.step(4)  # the peak
    assert group_lrs(optimizer) == pytest.approx([0.01, 0.02])
    assert scheduler.get_mom() == [(pytest.approx(0.8), 0.99), (pytest.approx(0.85), 0.99)]
    scheduler.step(9)  # back at the bottom
    assert group_lrs(optimizer) == pytest.approx([0.001, 0.002])
    assert [g["betas"][0] for g in optimizer.param_groups] == pytest.approx([0.9, 0.95])


def test_one_cycle_decay_and_its_edges() -> None:
    optimizer = adam(1.0)
    scheduler = OneCycle(optimizer, 0.1, 1.0, decay_lr_rate=0.5, cycle_first_step_size=2, decay_step_size=2,
                         decay_mom_rate=0.1)
    scheduler.step(6)  # decay interval (6 - 4 + 1) / 2
    assert group_lrs(optimizer) == pytest.approx([0.1 / 1.75])
    assert optimizer.param_groups[0]["betas"] == pytest.approx((0.9 * 1.15, 0.99))
    ramp = OneCycle(adam(1.0), 0.001, 0.1, cycle_first_step_size=100, cycle_second_step_size=0)
    assert ramp.step_ratio == 1.0
    sgd = OneCycle(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), 0.1, 1.0, cycle_first_step_size=2)
    assert not sgd.cycle_momentum and sgd.get_mom() is None


def test_state_dict_is_deepspeeds() -> None:
    optimizer = adam(1.0)
    scheduler = WarmupLR(optimizer, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    for _ in range(3):
        scheduler.step()
    assert scheduler.state_dict() == {"last_batch_iteration": 2}
    resumed = WarmupLR(adam(1.0), warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    resumed.load_state_dict(scheduler.state_dict())
    resumed.step()
    assert resumed.get_last_lr() == pytest.approx([0.75])
    resumed.load_state_dict({"last_epoch": 3})  # torch's counting, one ahead of DeepSpeed's
    assert resumed.last_batch_iteration == 2 and resumed.last_epoch == 2
