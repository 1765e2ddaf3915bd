"""Pipeline x tensor x data parallelism in one job, against one process training the same layers.

One world of 8 ranks, ``PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)``: each stage's
two tensor-parallel ranks split the MLP blocks' linear layers (up column-wise, down row-wise) with
``tensor_parallel.autotp_size`` 2, each (stage, tensor index) trains with ZeRO over its two
data-parallel ranks, and a tied embedding spans the stages; without a pipeline, tensor 2 x data 4 with
MiCS and hpZ groups inside the data axis equals one process too.  At ZeRO stages 1 and 3 with each
one-chunk schedule, and with the interleaved one, five batches equal one process training the whole
model with gradient accumulation on the global batch (1e-5); the groups are where [Note: the order
of the axes] in zeroshard/distributed/parallel_dims.py puts them; a checkpoint save is refused with a
named error (checkpoints of a three-axis job are not there yet), and an ``autotp_size`` that
disagrees with the topology is refused on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.pipe import LayerSpec, PipeModelDataParallelTopology, PipelineModule, TiedLayerSpec
from zeroshard.pipeline import PipelineUsageError
from zeroshard.tensor_parallel import TensorParallelSizeError
from zeroshard.tools.testing import check_family, run_family

pytestmark = pytest.mark.slow

V, D, MICRO, ACCUM, STEPS, LR, WD, CLIP, BLOCKS = 29, 8, 2, 4, 5, 1e-2, 0.1, 0.5, 4
PP, TP, DP = 2, 2, 2


class Mlp(nn.Module):
    """A residual MLP block: ``up`` is split column-wise, ``down`` row-wise."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


def logits(embedding: nn.Module, x: torch.Tensor) -> Any:
    return x @ embedding.weight.t()


def loss_fn(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float().reshape(-1, V), labels.reshape(-1))


def specs() -> list[Any]:
    return [TiedLayerSpec("embed", nn.Embedding, V, D), *[LayerSpec(Mlp, D) for _ in range(BLOCKS)],
            LayerSpec(nn.LayerNorm, D), TiedLayerSpec("embed", nn.Embedding, V, D, forward_fn=logits)]


#: the plan: every block's up column-wise, down row-wise; the embedding and the norm stay whole
PLAN = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.up\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.down\.weight$"], "partition_type": "row"}]}


def micro_batch(step: int, j: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * j + d)
    data = torch.randint(0, V, (MICRO, 5 + (step + j) % 3), generator=g)
    return data[:, :-1], data[:, 1:]


class Reference:
    """The same layers in one process, built from the seeds the pipeline uses; AdamW, accumulation."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.modules: dict[int, nn.Module] = {}
        embed = None
        for index, spec in enumerate(specs()):
            torch.manual_seed(1234 + index)
            if isinstance(spec, TiedLayerSpec):
                if embed is None:
                    embed = self.modules[index] = spec.build()
                self.calls.append((lambda x, m=embed, f=spec.forward_fn: f(m, x)) if spec.forward_fn else embed)
            else:
                self.modules[index] = spec.build()
                self.calls.append(self.modules[index])
        self.params = [p for m in self.modules.values() for p in m.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD)

    def forward(self, x: Any) -> Any:
        for call in self.calls:
            x = call(x)
        return x

    def train_step(self, step: int) -> float:
        total = 0.0
        for j in range(ACCUM):
            for d in range(DP):
                x, y = micro_batch(step, j, d)
                loss = loss_fn(self.forward(x), y)
                (loss / (ACCUM * DP)).backward()
                total += float(loss.detach()) / (ACCUM * DP)
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return total


def build(stage: int, schedule: str, chunks: int = 1, autotp: int = TP) -> tuple[Any, PipelineModule]:
    module = PipelineModule(specs(), topology=PipeModelDataParallelTopology(num_pp=PP, num_mp=TP, num_dp=DP),
                            loss_fn=loss_fn, seed_layers=True, partition_method="uniform", virtual_stages=chunks)
    engine, _, _, _ = zeroshard.initialize(model=module, model_parameters=module.parameters(), config={
        "train_batch_size": MICRO * ACCUM * DP, "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage}, "pipeline": {"schedule": schedule},
        "tensor_parallel": {"autotp_size": autotp, "partition_config": PLAN}})
    return engine, module


def full_parameters(module: PipelineModule) -> dict[int, list[torch.Tensor]]:
    """Each layer this rank holds (tied copies aside), its parameters joined over the tensor group."""
    groups = module.groups
    assert groups.tensor is not None
    out: dict[int, list[torch.Tensor]] = {}
    for index, call in module.layer_calls().items():
        spec = module.layer_specs[index]
        if isinstance(spec, TiedLayerSpec):
            if index != 0:
                continue
            call = module.tied_modules[spec.key]
        if not isinstance(call, nn.Module):
            continue
        values = []
        with zeroshard.GatheredParameters(list(call.parameters())):
            for name, p in call.named_parameters():
                value = p.detach().clone()
                dim = {"up.weight": 0, "up.bias": 0, "down.weight": 1}.get(name)
                if dim is not None:  # this rank's part: join the group's
                    parts = [torch.empty_like(value) for _ in range(TP)]
                    torch.distributed.all_gather(parts, value, group=groups.tensor.world.group)
                    value = torch.cat(parts, dim=dim)
                values.append(value)
        out[index] = values
    return out


def train_worker(rank: int, world: int, stage: int, schedule: str, chunks: int = 1) -> dict[str, Any]:
    engine, module = build(stage, schedule, chunks)
    groups = module.groups
    reference = Reference()
    losses, expected = [], []
    for step in range(STEPS):
        batches = iter([micro_batch(step, j, groups.data) for j in range(ACCUM)])
        losses.append(float(engine.train_batch(batches)))
        expected.append(reference.train_step(step))
    errors = []
    for index, values in full_parameters(module).items():
        for mine, theirs in zip(values, reference.modules[index].parameters()):
            errors.append(float((mine - theirs.detach()).norm() / theirs.detach().norm()))
    placement = (groups.stage, groups.data, groups.tensor_index, tuple(torch.distributed.get_process_group_ranks(
        groups.tensor.world.group)), engine.world.world_size)
    engine.close()
    return {"losses": losses, "expected": expected, "errors": errors, "placement": placement}


def check_train(by_rank: list[dict[str, Any]], stage: int, schedule: str, chunks: int = 1) -> None:
    for rank, out in enumerate(by_rank):
        for got, want in zip(out["losses"], out["expected"]):
            assert abs(got - want) <= 1e-5 * abs(want), (rank, out["losses"], out["expected"])
        assert out["errors"] and max(out["errors"]) <= 1e-5, (rank, out["errors"])
        # rank = (stage * dp + data) * tp + tensor: tensor-parallel ranks are neighbours
        stage_, data, tensor, tensor_group, data_size = out["placement"]
        assert rank == (stage_ * DP + data) * TP + tensor and tensor_group == (rank - tensor, rank - tensor + 1)
        assert data_size == DP


def refusals_worker(rank: int, world: int, root: str) -> list[str]:
    raised = []
    try:
        build(1, "1f1b", autotp=0)
    except TensorParallelSizeError as error:
        raised.append(type(error).__name__)
    engine, _ = build(1, "1f1b")
    try:
        engine.save_checkpoint(root)
    except PipelineUsageError as error:
        raised.append(type(error).__name__)
    engine.close()
    return raised


def check_refusals(by_rank: list[list[str]], root: str) -> None:
    assert all(raised == ["TensorParallelSizeError", "PipelineUsageError"] for raised in by_rank), by_rank


def sequential() -> nn.Sequential:
    """The blocks alone as one model (no pipeline), each built from the seed the reference uses."""
    blocks = []
    for index in range(1, BLOCKS + 1):
        torch.manual_seed(1234 + index)
        blocks.append(Mlp(D))
    return nn.Sequential(*blocks)


def hybrid_worker(rank: int, world: int, stage: int, zero: dict[str, Any]) -> dict[str, Any]:
    """Tensor 2 x data 4 without a pipeline, with MiCS or hpZ groups inside the data axis."""
    tp, dp = 2, world // 2
    model, reference = sequential(), sequential()
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2, "gradient_clipping": CLIP,
        "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage, **zero},
        "tensor_parallel": {"autotp_size": tp, "partition_config": PLAN}})
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    data_rank = rank // tp

    def sample(step: int, j: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + 10 * j + d)
        return torch.randn(MICRO, 3, D, generator=g), torch.randn(MICRO, 3, D, generator=g)

    for step in range(STEPS):
        for j in range(2):
            x, y = sample(step, j, data_rank)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        for j in range(2):
            for d in range(dp):
                x, y = sample(step, j, d)
                (nn.functional.mse_loss(reference(x), y) / (2 * dp)).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    full = engine.full_state_dict(rank0_only=False)
    errors = [float((full[k] - v).norm() / v.norm()) for k, v in reference.state_dict().items()]
    groups = engine.strategy.comm.world.world_size
    engine.close()
    return {"errors": errors, "shard_group": groups}


def check_hybrid(by_rank: list[dict[str, Any]], stage: int, zero: dict[str, Any]) -> None:
    for rank, out in enumerate(by_rank):
        assert max(out["errors"]) <= 1e-5, (rank, out["errors"])
        assert out["shard_group"] == zero.get("mics_shard_size", 4), (rank, out["shard_group"])


WORKERS = {"train": train_worker, "refusals": refusals_worker, "hybrid": hybrid_worker}
CHECKS = {"train": check_train, "refusals": check_refusals, "hybrid": check_hybrid}


def test_three_axes_match_one_process(tmp_path: Any) -> None:
    cases: list[tuple[str, dict[str, Any]]] = [
        ("train", {"stage": 1, "schedule": "1f1b"}), ("train", {"stage": 3, "schedule": "1f1b"}),
        ("train", {"stage": 3, "schedule": "gpipe"}),
        ("train", {"stage": 1, "schedule": "interleaved_1f1b", "chunks": 2}),
        ("refusals", {"root": str(tmp_path / "refused")}),
        # tensor 2 x data 4 without a pipeline: MiCS and hpZ groups inside the data axis
        ("hybrid", {"stage": 1, "zero": {"mics_shard_size": 2}}), ("hybrid", {"stage": 3, "zero": {"mics_shard_size": 2}}),
        ("hybrid", {"stage": 3, "zero": {"zero_hpz_partition_size": 2}})]
    check_family(cases, run_family(PP * TP * DP, cases, WORKERS), CHECKS, world=PP * TP * DP)
