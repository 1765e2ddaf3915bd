"""Config keys that real DeepSpeed configs carry have their effect: prescaled averaging equals the default
average, csv_monitor writes DeepSpeed's one-file-per-metric CSVs, steps_per_print Infinity never logs,
``seed`` decides every rank's random numbers and the data order."""

import os

import pytest
import torch
from torch.utils.data import TensorDataset

import zeroshard
from zeroshard.tools.testing import run_world

from zs_common import global_batch, make_model, rank_micro_batches, zero_config


def train(rank: int, world: int, stage: int, extra: dict, steps: int = 3):
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=make_model(), config={**zero_config(stage, 2, 2), **extra})
    for step in range(steps):
        for x, y in rank_micro_batches(step, rank, world, 2, 2):
            engine.backward(engine(x, y))
            engine.step()
    return engine.full_state_dict()


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
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


def seeded_worker(rank: int, world: int, seed: int) -> dict:
    """Three steps whose only randomness is the config's ``seed``: the generator is scrambled from the OS
    just before initialize(), so a run repeats only if initialize() seeds torch on this rank, and the
    batches come from the loader that initialize() builds, whose shuffle only the seed decides."""
    model = make_model()  # seeds itself: the same weights in every run
    torch.manual_seed(int.from_bytes(os.urandom(7), "little"))
    data = TensorDataset(*global_batch(0, 24))
    engine, _, loader, _ = zeroshard.initialize(model=model, training_data=data,
                                                config={**zero_config(2, 2, 1), "seed": seed})
    drawn = torch.rand(4)  # torch's generator right after initialize()
    losses = []
    for step, (x, y) in zip(range(3), loader):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return {"drawn": drawn, "losses": losses}


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_different_seeds_give_different_runs() -> None:
    first = run_world(seeded_worker, 2, args=(1,))
    again = run_world(seeded_worker, 2, args=(1,))
    other = run_world(seeded_worker, 2, args=(2,))
    for rank in range(2):
        # the same seed: the same draws and the same data order, bitwise, on every rank
        assert torch.equal(first[rank]["drawn"], again[rank]["drawn"]), rank
        assert first[rank]["losses"] == again[rank]["losses"], rank
        # another seed: other draws, and another shuffle (other batches, so other losses)
        assert not torch.equal(first[rank]["drawn"], other[rank]["drawn"]), rank
        assert first[rank]["losses"][0] != other[rank]["losses"][0], rank
    assert first[0]["losses"] != first[1]["losses"]  # the ranks read different parts of each batch
