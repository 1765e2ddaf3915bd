"""Config keys that real DeepSpeed configs carry have their effect: prescaled averaging equals the default
average, csv_monitor writes DeepSpeed's one-file-per-metric CSVs, steps_per_print Infinity never logs."""

import pytest
import torch

import zeroshard
from zeroshard.testing import run_world

from zs_common import make_model, rank_micro_batches, zero_config


def train(rank: int, world: int, stage: int, extra: dict, steps: int = 3):
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=make_model(), config={**zero_config(stage, 2, 2), **extra})
    for step in range(steps):
        for x, y in rank_micro_batches(step, rank, world, 2, 2):
            engine.backward(engine(x, y))
            engine.step()
    return engine.full_state_dict()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_prescaled_gradient_averaging_equals_the_default_average(stage) -> None:
    default = run_world(train, 3, args=(stage, {}))[0]
    prescaled = run_world(train, 3, args=(stage, {"prescale_gradients": True, "gradient_predivide_factor": 2.0}))[0]
    for name, value in default.items():
        torch.testing.assert_close(prescaled[name], value, rtol=1e-5, atol=1e-7, msg=name)


def test_csv_monitor_writes_one_file_per_metric(tmp_path) -> None:
    extra = {"steps_per_print": 1, "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}}
    run_world(train, 2, args=(1, extra))
    loss = (tmp_path / "run" / "loss.csv").read_text().splitlines()
    assert loss[0] == "step,loss" and [line.split(",")[0] for line in loss[1:]] == ["1", "2", "3"]
    assert (tmp_path / "run" / "lr.csv").is_file() and (tmp_path / "run" / "tokens_per_s.csv").is_file()


def test_steps_per_print_infinity_never_logs(tmp_path) -> None:
    metrics = tmp_path / "m.jsonl"
    run_world(train, 2, args=(2, {"steps_per_print": float("inf"), "metrics_path": str(metrics)}))
    assert not metrics.exists()
