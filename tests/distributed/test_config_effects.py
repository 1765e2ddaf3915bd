"""Config keys that real DeepSpeed configs carry have their effect: prescaled averaging equals the default
average, gradient_allreduce_op "sum" adds the ranks' gradients (against PyTorch), csv_monitor writes
DeepSpeed's one-file-per-metric CSVs, steps_per_print Infinity never logs,
``seed`` decides every rank's random numbers and the data order.  Each family runs in one world that
builds and closes an engine per case."""

import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import zeroshard
from zeroshard.tools.testing import CaseFailures, case, run_world

from zs_common import global_batch, make_model, rank_micro_batches, zero_config


def train(rank: int, world: int, stage: int, extra: dict, steps: int = 3) -> dict:
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=make_model(), config={**zero_config(stage, 2, 2), **extra})
    for step in range(steps):
        for x, y in rank_micro_batches(step, rank, world, 2, 2):
            engine.backward(engine(x, y))
            engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


def train_worker(rank: int, world: int, cases: dict[str, tuple[int, dict]]) -> dict[str, dict]:
    """Every case (name -> (stage, extra config)) trained in turn; rank 0's final weights by case."""
    out = {}
    for name, (stage, extra) in cases.items():
        with case(config=name, stage=stage, world=world):
            out[name] = train(rank, world, stage, extra)
    return out


PRESCALED = {"prescale_gradients": True, "gradient_predivide_factor": 2.0}
PRESCALED_STAGES = (0, 2, 3)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_prescaled_gradient_averaging_equals_the_default_average() -> None:
    cases = {f"{kind} stage {stage}": (stage, extra) for stage in PRESCALED_STAGES
             for kind, extra in (("default", {}), ("prescaled", PRESCALED))}
    states = run_world(train_worker, 3, args=(cases,), timeout=600)[0]
    failures = CaseFailures()
    for stage in PRESCALED_STAGES:
        with failures.case(stage=stage, world=3):
            default, prescaled = states[f"default stage {stage}"], states[f"prescaled stage {stage}"]
            for name, value in default.items():
                torch.testing.assert_close(prescaled[name], value, rtol=1e-5, atol=1e-7, msg=name)
    failures.raise_any()


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> Path:
    """One world trains both logging configs: csv_monitor at stage 1, steps_per_print Infinity at stage 2."""
    root = tmp_path_factory.mktemp("logging")
    cases = {
        "csv_monitor": (1, {"steps_per_print": 1,
                            "csv_monitor": {"enabled": True, "output_path": str(root), "job_name": "run"}}),
        "steps_per_print_infinity": (2, {"steps_per_print": float("inf"), "metrics_path": str(root / "m.jsonl")}),
    }
    run_world(train_worker, 2, args=(cases,), timeout=600)
    return root


def test_csv_monitor_writes_one_file_per_metric(logged: Path) -> None:
    loss = (logged / "run" / "loss.csv").read_text().splitlines()
    assert loss[0] == "step,loss" and [line.split(",")[0] for line in loss[1:]] == ["1", "2", "3"]
    assert (logged / "run" / "lr.csv").is_file() and (logged / "run" / "tokens_per_s.csv").is_file()


def test_steps_per_print_infinity_never_logs(logged: Path) -> None:
    assert not (logged / "m.jsonl").exists()


def seeded_run(rank: int, seed: int) -> dict:
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
    engine.close()
    return {"drawn": drawn, "losses": losses}


#: run name -> the config's seed; "again" repeats "first" later in the same process
SEEDED_RUNS = {"first": 1, "again": 1, "other": 2}


def seeded_worker(rank: int, world: int) -> dict:
    out = {}
    for name, seed in SEEDED_RUNS.items():
        with case(run=name, seed=seed, world=world):
            out[name] = seeded_run(rank, seed)
    return out


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_different_seeds_give_different_runs() -> None:
    runs = run_world(seeded_worker, 2, timeout=600)
    first, again, other = ([r[name] for r in runs] for name in SEEDED_RUNS)
    for rank in range(2):
        # the same seed: the same draws and the same data order, bitwise, on every rank
        assert torch.equal(first[rank]["drawn"], again[rank]["drawn"]), rank
        assert first[rank]["losses"] == again[rank]["losses"], rank
        # another seed: other draws, and another shuffle (other batches, so other losses)
        assert not torch.equal(first[rank]["drawn"], other[rank]["drawn"]), rank
        assert first[rank]["losses"][0] != other[rank]["losses"][0], rank
    assert first[0]["losses"] != first[1]["losses"]  # the ranks read different parts of each batch


SUM_LR = 0.5
#: case -> (stage, extra config); "mean" is the control a summing engine must differ from
ALLREDUCE_OP_CASES = {
    "sum stage 0": (0, {"gradient_allreduce_op": "sum"}),
    "sum stage 1": (1, {"gradient_allreduce_op": "SUM"}),
    "sum stage 2": (2, {"gradient_allreduce_op": "sum"}),
    "sum stage 2 prescaled": (2, {"gradient_allreduce_op": "sum", **PRESCALED}),
    "mean stage 2": (2, {"gradient_allreduce_op": "mean"}),
}


def one_sgd_step_worker(rank: int, world: int, cases: dict[str, tuple[int, dict]]) -> dict[str, dict]:
    """Every case: one optimizer step of plain SGD (no clipping), so the weights move by lr x the reduced
    gradient exactly; rank 0's weights after it, by case."""
    out = {}
    for name, (stage, extra) in cases.items():
        with case(config=name, stage=stage, world=world):
            config = {**zero_config(stage, 2, 1), "gradient_clipping": 0.0,
                      "optimizer": {"type": "SGD", "params": {"lr": SUM_LR}}, **extra}
            engine, *_ = zeroshard.initialize(model=make_model(), config=config)
            for x, y in rank_micro_batches(0, rank, world, 2, 1):
                engine.backward(engine(x, y))
            engine.step()
            out[name] = engine.full_state_dict()
            engine.close()
    return out


def sgd_reference(world: int, divide_by: int) -> dict:
    """PyTorch alone: each rank's gradient computed on its own micro batch, summed over the ranks (and
    divided by ``divide_by``), one SGD step."""
    model = make_model()
    grads: dict[str, torch.Tensor] = {}
    for rank in range(world):
        model.zero_grad()
        for x, y in rank_micro_batches(0, rank, world, 2, 1):
            model(x, y).backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                grads[name] = grads.get(name, torch.zeros_like(p)) + p.grad
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in grads:
                p.sub_(SUM_LR * grads[name] / divide_by)
    return model.state_dict()


def test_gradient_allreduce_op_sum_adds_the_ranks_gradients() -> None:
    world = 2
    states = run_world(one_sgd_step_worker, world, args=(ALLREDUCE_OP_CASES,), timeout=600)[0]
    summed, averaged = sgd_reference(world, 1), sgd_reference(world, world)
    failures = CaseFailures()
    for name in ALLREDUCE_OP_CASES:
        expected = averaged if name.startswith("mean") else summed
        with failures.case(config=name, world=world):
            for key, value in expected.items():
                torch.testing.assert_close(states[name][key], value, rtol=1e-5, atol=1e-6, msg=key)
    failures.raise_any()
