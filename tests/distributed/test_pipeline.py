"""Pipeline parallelism with ZeRO: ``train_batch`` against one process training the same layers.

One world of 4 ranks runs every case: pipeline 2 x data 2 at ZeRO stages 0-3 with each schedule,
pipeline 4 x data 1, evaluation, and the refused inputs.  The model has a tied embedding (first and
last stage), tuples of tensors of two dtypes between stages, and a sequence length that changes from
one micro-batch to the next.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import zeroshard
from zeroshard.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zeroshard.pipeline import (PipelineBatchSizeError, PipelineUsageError, StagesDoNotDivideError,
                                TooFewLayersError)
from zeroshard.tools.testing import check_family, run_family

V, D, MICRO, ACCUM, STEPS, LR, WD, CLIP = 23, 8, 2, 3, 5, 1e-2, 0.1, 0.5


class Positions(nn.Module):
    """Hidden states and their positions (int64): a tuple of two dtypes travels between stages."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.arange(x.shape[1]).expand(x.shape[0], -1)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, pos = inputs
        return x + torch.tanh(self.fc(x)) * (1 + pos.unsqueeze(-1) % 3), pos


def drop_positions(inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return inputs[0]


def logits(embedding: nn.Module, x: torch.Tensor) -> Any:
    return x @ embedding.weight.t()


def loss_fn(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, V), labels.reshape(-1))


def specs() -> list[Any]:
    return [TiedLayerSpec("embed", nn.Embedding, V, D), Positions(), LayerSpec(Block, D), LayerSpec(Block, D),
            LayerSpec(Block, D), drop_positions, LayerSpec(nn.LayerNorm, D),
            TiedLayerSpec("embed", nn.Embedding, V, D, forward_fn=logits)]


def micro_batch(step: int, j: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``d``'s micro-batch ``j`` of ``step``; its length varies with ``j``."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * j + d)
    data = torch.randint(0, V, (MICRO, 4 + (step + j) % 3 + 1), generator=g)
    return data[:, :-1], data[:, 1:]


class Reference:
    """The same layers in one process (each built from the seed the pipeline uses), AdamW, accumulation."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.modules: dict[int, nn.Module] = {}
        embed = None
        for index, spec in enumerate(specs()):
            if isinstance(spec, TiedLayerSpec):
                if embed is None:
                    torch.manual_seed(1234 + index)
                    embed = spec.build()
                    self.modules[index] = embed
                module = embed
                self.calls.append((lambda x, m=module, f=spec.forward_fn: f(m, x)) if spec.forward_fn else module)
            elif isinstance(spec, LayerSpec):
                torch.manual_seed(1234 + index)
                self.modules[index] = spec.build()
                self.calls.append(self.modules[index])
            else:
                self.calls.append(spec)
        params = [p for m in self.modules.values() for p in m.parameters()]
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WD)

    def forward(self, x: Any) -> Any:
        for call in self.calls:
            x = call(x)
        return x

    def train_step(self, step: int, dp: int) -> float:
        total = 0.0
        for j in range(ACCUM):
            for d in range(dp):
                x, y = micro_batch(step, j, d)
                loss = loss_fn(self.forward(x), y)
                (loss / (ACCUM * dp)).backward()
                total += float(loss.detach()) / (ACCUM * dp)
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return total

    def eval_loss(self, step: int, dp: int) -> float:
        with torch.no_grad():
            return sum(float(loss_fn(self.forward(micro_batch(step, j, d)[0]), micro_batch(step, j, d)[1]))
                       for j in range(ACCUM) for d in range(dp)) / (ACCUM * dp)


def config(stage: int, schedule: str, dp: int, **more: Any) -> dict[str, Any]:
    return {"train_batch_size": MICRO * ACCUM * dp, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": {"stage": stage}, "pipeline": {"schedule": schedule}, **more}


def build(pp: int, stage: int, schedule: str) -> tuple[Any, PipelineModule]:
    module = PipelineModule(specs(), num_stages=pp, loss_fn=loss_fn, seed_layers=True,
                            partition_method="uniform" if pp == 4 else "parameters")
    engine, _, _, _ = zeroshard.initialize(model=module, model_parameters=module.parameters(),
                                           config=config(stage, schedule, 4 // pp))
    return engine, module


def data(step: int, d: int) -> Any:
    return iter([micro_batch(step, j, d) for j in range(ACCUM)])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def stage_param_errors(module: PipelineModule, reference: Reference) -> list[float]:
    """Each parameter this stage owns against the reference's (tied copies are not owned)."""
    start, stop = module.stage_layers()
    errors = []
    owned: list[tuple[nn.Module, nn.Module]] = []
    for index in range(start, stop):
        call = module._calls[index - start]
        spec = module.layer_specs[index]
        if isinstance(spec, TiedLayerSpec):
            if index == 0:
                owned.append((module.tied_modules[spec.key], reference.modules[0]))
        elif index in reference.modules:
            owned.append((call, reference.modules[index]))
    for mine, theirs in owned:
        params = list(mine.parameters())
        with zeroshard.GatheredParameters(params):
            for p, q in zip(params, theirs.parameters()):
                errors.append(relative(p.detach(), q.detach()))
    return errors


def train_worker(rank: int, world: int, pp: int, stage: int, schedule: str) -> dict[str, Any]:
    engine, module = build(pp, stage, schedule)
    dp = 4 // pp
    data_rank = rank % dp
    reference = Reference()
    losses, expected = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(data(step, data_rank))))
        expected.append(reference.train_step(step, dp))
    errors = stage_param_errors(module, reference)
    tied_error = 0.0
    if module.tied.ties[0].copy is not None:  # a later stage's copy of the tied embedding
        tied_error = relative(module.tied.ties[0].copy.detach(), reference.modules[0].weight.detach())
    eval_loss = float(engine.eval_batch(data(STEPS, data_rank)))
    engine.close()
    return {"losses": losses, "expected": expected, "errors": errors, "tied": tied_error,
            "eval": eval_loss, "eval_expected": reference.eval_loss(STEPS, dp)}


def check_train(by_rank: list[dict[str, Any]], pp: int, stage: int, schedule: str) -> None:
    for rank, out in enumerate(by_rank):
        for got, want in zip(out["losses"], out["expected"]):
            assert abs(got - want) <= 1e-5 * abs(want), (rank, out["losses"], out["expected"])
        assert out["errors"] and max(out["errors"]) <= 1e-5, (rank, out["errors"])
        assert out["tied"] <= 1e-5, (rank, out["tied"])
        assert abs(out["eval"] - out["eval_expected"]) <= 1e-5 * abs(out["eval_expected"]), (rank, out)


def refusals_worker(rank: int, world: int) -> list[str]:
    raised = []
    for attempt in (lambda: PipelineModule(specs(), num_stages=3),
                    lambda: PipelineModule(specs()[:3], num_stages=4),
                    lambda: zeroshard.initialize(model=PipelineModule(specs(), num_stages=2, loss_fn=loss_fn),
                                                 config={**config(0, "1f1b", 2), "train_batch_size": 7})):
        try:
            attempt()
        except (StagesDoNotDivideError, TooFewLayersError, PipelineBatchSizeError) as error:
            raised.append(type(error).__name__)
    engine, _ = build(2, 0, "1f1b")
    for call in (lambda: engine(torch.zeros(1)), lambda: engine.backward(torch.zeros(())), engine.step):
        try:
            call()
        except PipelineUsageError as error:
            raised.append(type(error).__name__)
    engine.close()
    return raised


def check_refusals(by_rank: list[list[str]]) -> None:
    for raised in by_rank:
        assert raised == ["StagesDoNotDivideError", "TooFewLayersError", "PipelineBatchSizeError"] + \
            ["PipelineUsageError"] * 3, raised


WORKERS = {"train": train_worker, "refusals": refusals_worker}
CHECKS = {"train": check_train, "refusals": check_refusals}


def test_pipeline_matches_one_process() -> None:
    cases: list[tuple[str, dict[str, Any]]] = [
        ("train", {"pp": 2, "stage": stage, "schedule": schedule})
        for stage in (0, 1, 2, 3) for schedule in ("1f1b", "gpipe")]
    cases += [("train", {"pp": 4, "stage": 1, "schedule": "1f1b"}), ("train", {"pp": 4, "stage": 3, "schedule": "gpipe"}),
              ("refusals", {})]
    check_family(cases, run_family(4, cases, WORKERS), CHECKS, world=4)
