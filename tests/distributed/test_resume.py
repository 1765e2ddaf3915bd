"""Exact resume with the engine's own data loader and a model that draws random numbers (dropout).

The resumed run must repeat the uninterrupted one bit for bit: the same batches in the same order
(the loader's recorded position), the same dropout masks (torch's RNG restored, and the loader never
drawing from it), the same parameters.  Scripts loop as users write them: ``for batch in loader``
with a ``break`` and an outer loop that iterates again.
"""

from pathlib import Path

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.testing import run_world

VOCAB, SEQ, SAMPLES = 23, 6, 40  # 40 samples, micro batch 2, world 2: an epoch is 10 steps per rank


class DropoutLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.drop(self.emb(x)))
        return nn.functional.cross_entropy(logits.view(-1, VOCAB), y.view(-1))


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:])


def train(engine, loader, steps: int) -> list[float]:
    """Loops as scripts write them: a ``break`` mid-epoch, and an outer loop that iterates again."""
    losses: list[float] = []
    while len(losses) < steps:
        for x, y in loader:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            if len(losses) == steps:
                break
    return losses


def worker(rank: int, world: int, stage: int, phase: str, directory: str) -> dict:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "seed": 1, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, _, loader, _ = zeroshard.initialize(model=DropoutLM(), config=config, training_data=dataset())
    if phase == "second":
        engine.load_checkpoint(directory)  # the engine owns the loader: RNG and position come back
    steps = {"full": 16, "first": 7, "second": 9}[phase]
    losses = train(engine, loader, steps)
    if phase == "first":
        engine.save_checkpoint(directory)
    return {"losses": losses, "state": engine.full_state_dict(), "position": loader.state_dict()}


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_with_dropout_and_the_engines_loader_is_bitwise(stage: int, tmp_path: Path) -> None:
    full = run_world(worker, 2, args=(stage, "full", str(tmp_path / "unused")))
    first = run_world(worker, 2, args=(stage, "first", str(tmp_path)))
    second = run_world(worker, 2, args=(stage, "second", str(tmp_path)))
    for rank in range(2):
        assert first[rank]["losses"] + second[rank]["losses"] == full[rank]["losses"]
        assert second[rank]["position"] == full[rank]["position"] == {"epoch": 1, "consumed": 6,
                                                                     "micro_batch_size": 2}
    for name, value in full[0]["state"].items():
        assert torch.equal(second[0]["state"][name], value), name


def test_iterating_again_after_a_break_continues_the_epoch_and_draws_no_random_numbers(monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    _, _, loader, _ = zeroshard.initialize(model=DropoutLM(), config=config, training_data=dataset())
    _, _, reference, _ = zeroshard.initialize(model=DropoutLM(), config=config, training_data=dataset())
    expected = [x for x, _ in reference]  # one whole epoch: 10 batches
    rng = torch.get_rng_state()
    seen = []
    for x, _ in loader:
        seen.append(x)
        if len(seen) == 3:
            break
    assert loader.state_dict()["consumed"] == 3
    for x, _ in loader:  # continues with batch 4, not batch 1
        seen.append(x)
    assert len(seen) == len(expected) == 10
    assert all(torch.equal(a, b) for a, b in zip(seen, expected))
    assert loader.state_dict() == {"epoch": 1, "consumed": 0, "micro_batch_size": 4}
    assert torch.equal(torch.get_rng_state(), rng), "the loader drew from torch's global generator"
    second_epoch = [x for x, _ in loader]
    assert len(second_epoch) == 10 and not all(torch.equal(a, b) for a, b in zip(second_epoch, expected))
