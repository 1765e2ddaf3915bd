"""Exact resume with the engine's own data loader and a model that draws random numbers (dropout).

The resumed run must repeat the uninterrupted one bit for bit: the same batches in the same order
(the loader's recorded position), the same dropout masks (torch's RNG restored, and the loader never
drawing from it), the same parameters.  Scripts loop as users write them: ``for batch in loader``
with a ``break`` and an outer loop that iterates again.

A run resumed with another gradient accumulation (and micro batch, and world size) for the same global
batch trains on as if it had never stopped: a load resumes at a step boundary.
"""

from pathlib import Path

import pytest
import torch
from torch import nn
from zs_common import CLIP, LR, WD, make_model, max_rel_diff, rank_micro_batches, zero_config

import zeroshard
from zeroshard.tools.testing import CaseFailures, case, run_world

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


def run_phase(rank: int, stage: int, phase: str, directory: str) -> dict:
    """``full`` trains 16 steps, ``first`` 7 and saves, ``second`` loads that save and trains the other 9."""
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
    result = {"losses": losses, "state": engine.full_state_dict(), "position": loader.state_dict()}
    engine.close()
    return result


def worker(rank: int, world: int, stages: tuple[int, ...], root: str) -> dict:
    """Every stage's three runs in turn; each run's engine is closed before the next, so the resumed run
    gets from the first only what its checkpoint holds."""
    out = {}
    for stage in stages:
        with case(stage=stage, world=world):
            directory = str(Path(root) / f"stage{stage}")
            out[stage] = {phase: run_phase(rank, stage, phase, directory) for phase in ("full", "first", "second")}
    return out


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_resume_with_dropout_and_the_engines_loader_is_bitwise(tmp_path: Path) -> None:
    stages = (2, 3)
    results = run_world(worker, 2, args=(stages, str(tmp_path)), timeout=600)
    failures = CaseFailures()
    for stage in stages:
        with failures.case(stage=stage, world=2):
            full, first, second = ([r[stage][phase] for r in results] for phase in ("full", "first", "second"))
            for rank in range(2):
                assert first[rank]["losses"] + second[rank]["losses"] == full[rank]["losses"]
                assert second[rank]["position"] == full[rank]["position"] == {"epoch": 1, "consumed": 6,
                                                                             "micro_batch_size": 2}
            for name, value in full[0]["state"].items():
                assert torch.equal(second[0]["state"][name], value), name
    failures.raise_any()


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


# A run saved with (world, micro batch, accumulation) and resumed with others, the global batch kept:
# each phase is (world, micro, accum, steps).  2 steps at accumulation 2 end at micro step 4, which is
# not a multiple of 3: the saved count would end the first step at accumulation 3 early.
CHANGED_ACCUMULATION = {
    "accum 1 -> 2, world 2 -> 2": ((2, 4, 1, 3), (2, 2, 2, 3)),
    "accum 2 -> 3, world 2 -> 1": ((2, 3, 2, 2), (1, 4, 3, 3)),
}
STAGE = 3


def train_steps(engine, rank: int, world: int, micro: int, accum: int, steps: range) -> None:
    for step in steps:
        for x, y in rank_micro_batches(step, rank, world, micro, accum):
            engine.backward(engine(x, y))
            engine.step()


def changed_accumulation_worker(rank: int, world: int, directory: str) -> dict:
    """Every phase of CHANGED_ACCUMULATION run at this world size: saves, then the loads of the same world
    (the run at another world size loads what this one saved)."""
    out = {}
    for change, ((save_world, save_micro, save_accum, saved), (load_world, micro, accum, resumed)) in \
            CHANGED_ACCUMULATION.items():
        path = str(Path(directory) / change.replace(" ", "_").replace(">", ""))
        if save_world == world:
            with case(change=change, phase="save", world=world):
                config = zero_config(STAGE, save_micro, save_accum)
                engine, _, _, _ = zeroshard.initialize(model=make_model(), config=config)
                train_steps(engine, rank, world, save_micro, save_accum, range(saved))
                engine.save_checkpoint(path)
                engine.close()
        if load_world == world:
            with case(change=change, phase="load", world=world):
                engine, _, _, _ = zeroshard.initialize(model=make_model(), config=zero_config(STAGE, micro, accum))
                engine.load_checkpoint(path)
                after_load = (engine.global_steps, engine.micro_steps)
                train_steps(engine, rank, world, micro, accum, range(saved, saved + resumed))
                out[change] = {"state": engine.full_state_dict(), "after_load": after_load,
                               "at_end": (engine.global_steps, engine.micro_steps)}
                engine.close()
    return out


def uninterrupted(schedule: list[tuple[int, int, int]]) -> nn.Module:
    """One process, never saved: step ``s`` takes the global batch split as ``schedule[s]`` =
    (world, micro, accum) splits it, each micro step's rows of every rank at once, AdamW, clipping."""
    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    for step, (world, micro, accum) in enumerate(schedule):
        per_rank = [rank_micro_batches(step, rank, world, micro, accum) for rank in range(world)]
        for m in range(accum):
            x = torch.cat([batches[m][0] for batches in per_rank])
            y = torch.cat([batches[m][1] for batches in per_rank])
            (model(x, y) / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def test_a_load_resumes_at_a_step_boundary_when_the_accumulation_changes(tmp_path: Path) -> None:
    """Stage 3, fp32: a checkpoint loaded with another accumulation (and micro batch, and world size) for the
    same global batch trains on as a run never saved; its first step takes the new accumulation's micro
    batches, not the ones the saved micro step count would leave it."""
    results = run_world(changed_accumulation_worker, 2, args=(str(tmp_path),))[0]
    results.update(run_world(changed_accumulation_worker, 1, args=(str(tmp_path),))[0])
    assert set(results) == set(CHANGED_ACCUMULATION)
    for change, ((save_world, save_micro, save_accum, saved), (world, micro, accum, resumed)) in \
            CHANGED_ACCUMULATION.items():
        reference = uninterrupted([(save_world, save_micro, save_accum)] * saved + [(world, micro, accum)] * resumed)
        ours = make_model()
        ours.load_state_dict(results[change]["state"])
        diff = max_rel_diff(ours, reference)
        assert diff <= 1e-5, f"{change}: parameters differ from the uninterrupted run by {diff:.2e}"
        assert results[change]["after_load"] == (saved, saved * accum), change
        assert results[change]["at_end"] == (saved + resumed, (saved + resumed) * accum), change
