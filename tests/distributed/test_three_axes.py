"""Pipeline x tensor x data parallelism in one job, against one process training the same layers.

One world of 8 ranks, ``PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)``: each stage's
two tensor-parallel ranks split the MLP blocks' linear layers (up column-wise, down row-wise) with
``tensor_parallel.autotp_size`` 2, each (stage, tensor index) trains with ZeRO over its two
data-parallel ranks, and a tied embedding spans the stages; without a pipeline, tensor 2 x data 4 with
MiCS and hpZ groups inside the data axis equals one process too.  A checkpoint saved at (pipeline 2,
tensor 2, data 2, ZeRO-1) resumes bitwise at its own layout and at other pipeline depths, tensor and
data degrees and ZeRO stages (each tensor index's part read joined and cut again by name), its parts
consolidate into the one-process weights, and a part missing a file is refused on every rank.  At
ZeRO-1 (1F1B and interleaved 1F1B) and ZeRO-3 (GPipe), five batches equal one process training the
whole model with gradient accumulation on the global batch (1e-5); the groups are where [Note: the
order of the axes] in zeroshard/distributed/parallel_dims.py puts them, and an ``autotp_size`` that
disagrees with the topology is refused on every rank.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.checkpoint.format import CheckpointError
from zeroshard.pipe import LayerSpec, PipeModelDataParallelTopology, PipelineModule, TiedLayerSpec
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


def build(stage: int, schedule: str, chunks: int = 1, autotp: int = TP, pp: int = PP, tp: int = TP,
          dp: int = DP) -> tuple[Any, PipelineModule]:
    """A pipeline of ``pp`` stages x ``dp`` x ``tp`` over the layers, training the global batch of
    ACCUM x DP micro-batches in ACCUM x DP / dp micro-batches per rank."""
    module = PipelineModule(specs(), topology=PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp),
                            loss_fn=loss_fn, seed_layers=True, partition_method="uniform", virtual_stages=chunks)
    accum = ACCUM * DP // dp
    engine, _, _, _ = zeroshard.initialize(model=module, model_parameters=module.parameters(), config={
        "train_batch_size": MICRO * ACCUM * DP, "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accum, "gradient_clipping": CLIP, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage}, "pipeline": {"schedule": schedule},
        "tensor_parallel": {"autotp_size": autotp, "partition_config": PLAN}})
    return engine, module


def batches(step: int, data: int, dp: int) -> Any:
    """Data-parallel rank ``data`` of ``dp``'s micro-batches of ``step``: the same global batch at any ``dp``."""
    accum = ACCUM * DP // dp
    return iter([micro_batch(step, k // DP, k % DP) for k in range(data * accum, (data + 1) * accum)])


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
        losses.append(float(engine.train_batch(batches(step, groups.data, DP))))
        expected.append(reference.train_step(step))
    errors = []
    for index, values in full_parameters(module).items():
        for mine, theirs in zip(values, reference.modules[index].parameters()):
            errors.append(float((mine - theirs.detach()).norm() / theirs.detach().norm()))
    # full_state_dict(): the stage's split tensors joined over its tensor group, by the tensor-parallel
    # slice part a plain tensor-parallel model's engine uses too (tensor_parallel/slices.py)
    want = reference_state(reference)
    for name, value in engine.full_state_dict(rank0_only=False).items():
        theirs = want.get(module.global_name(name))
        if theirs is not None and theirs.shape == value.shape:
            errors.append(float((value - theirs.detach()).norm() / theirs.detach().norm()))
        elif theirs is not None:
            errors.append(float("inf"))  # a split tensor not joined
    placement = (groups.stage, groups.data, groups.tensor_index, tuple(torch.distributed.get_process_group_ranks(
        groups.tensor.world.group)), engine.world.world_size, groups.describe())
    engine.close()
    return {"losses": losses, "expected": expected, "errors": errors, "placement": placement}


def check_train(by_rank: list[dict[str, Any]], stage: int, schedule: str, chunks: int = 1) -> None:
    for rank, out in enumerate(by_rank):
        for got, want in zip(out["losses"], out["expected"]):
            assert abs(got - want) <= 1e-5 * abs(want), (rank, out["losses"], out["expected"])
        assert out["errors"] and max(out["errors"]) <= 1e-5, (rank, out["errors"])
        # rank = (stage * dp + data) * tp + tensor: tensor-parallel ranks are neighbours
        stage_, data, tensor, tensor_group, data_size, layout = out["placement"]
        assert rank == (stage_ * DP + data) * TP + tensor and tensor_group == (rank - tensor, rank - tensor + 1)
        assert data_size == DP
        # what the engine reports (logged at initialize())
        assert layout == ("pipeline 2 x data 2 x tensor 2 over 8 ranks, numbered (stage * 2 + data) * 2 + tensor: "
                          "tensor-parallel groups [[0, 1], [2, 3], [4, 5], [6, 7]], data-parallel groups "
                          "[[0, 2], [1, 3], [4, 6], [5, 7]], pipelines [[0, 4], [1, 5], [2, 6], [3, 7]]"), layout


def refusals_worker(rank: int, world: int) -> list[str]:
    raised = []
    try:
        build(1, "1f1b", autotp=0)
    except TensorParallelSizeError as error:
        raised.append(type(error).__name__)
    return raised


def check_refusals(by_rank: list[list[str]]) -> None:
    assert all(raised == ["TensorParallelSizeError"] for raised in by_rank), by_rank


#: where the checkpoint saved at pipeline 2 x tensor 2 x data 2, ZeRO-1 is resumed: (pp, tp, dp, ZeRO
#: stage); the first is the saving layout (bitwise the uninterrupted run)
RESUMES = ((2, 2, 2, 1), (4, 1, 2, 1), (1, 2, 4, 3))


def checkpoint_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save after 3 batches, train 2 more; resume the save at each of RESUMES for those 2 batches; then
    remove one rank's file of one part and see every rank refuse the load."""
    engine, module = build(1, "1f1b")
    reference = Reference()
    for step in range(3):
        engine.train_batch(batches(step, module.groups.data, DP))
        reference.train_step(step)
    engine.save_checkpoint(root, "step3")
    straight = [float(engine.train_batch(batches(step, module.groups.data, DP))) for step in (3, 4)]
    engine.close()
    resumed = {}
    for pp, tp, dp, stage in RESUMES:
        engine, module = build(stage, "1f1b", pp=pp, tp=tp, dp=dp, autotp=tp if tp > 1 else 0)
        engine.load_checkpoint(root, "step3")
        resumed[(pp, tp, dp, stage)] = [float(engine.train_batch(batches(step, module.groups.data, dp)))
                                        for step in (3, 4)]
        engine.close()
    broken = Path(root + "_broken")
    torch.distributed.barrier()
    if rank == 0:  # a copy whose second part lost a rank's file
        shutil.copytree(root, broken)
        (broken / "mp_rank_01" / "step3" / "rank00002.safetensors").unlink()
    torch.distributed.barrier()
    engine, _ = build(1, "1f1b")
    refused = ""
    try:
        engine.load_checkpoint(broken, "step3")
    except CheckpointError as error:
        refused = type(error).__name__
    engine.close()
    return {"straight": straight, "resumed": resumed, "refused": refused,
            "reference": {k: v.detach().clone() for k, v in reference_state(reference).items()}}


def reference_state(reference: Reference) -> dict[str, torch.Tensor]:
    """The reference's weights under the job's names (``<layer index>.<parameter>``, the tied embedding once)."""
    return {f"{index}.{name}": p for index, m in reference.modules.items() for name, p in m.named_parameters()}


def check_checkpoint(by_rank: list[dict[str, Any]], root: str) -> None:
    from zeroshard.checkpoint.consolidate import full_state_dict

    for rank, out in enumerate(by_rank):
        assert out["refused"] == "CheckpointError", (rank, out["refused"])
        for layout, losses in out["resumed"].items():
            bound = 0.0 if layout == RESUMES[0] else 1e-5
            assert max(abs(a - b) for a, b in zip(losses, out["straight"])) <= bound * max(out["straight"]), \
                (rank, layout, losses, out["straight"])
    # the parts joined: the weights of the whole model after 3 batches, as the reference trained them
    full = full_state_dict(root, "step3")
    reference = by_rank[0]["reference"]
    assert full.keys() == reference.keys(), (sorted(full), sorted(reference))
    for key, value in reference.items():
        assert float((full[key] - value).norm() / value.norm()) <= 1e-5, key


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


WORKERS = {"train": train_worker, "refusals": refusals_worker, "hybrid": hybrid_worker,
           "checkpoint": checkpoint_worker}
CHECKS = {"train": check_train, "refusals": check_refusals, "hybrid": check_hybrid, "checkpoint": check_checkpoint}


def test_three_axes_match_one_process(tmp_path: Any) -> None:
    cases: list[tuple[str, dict[str, Any]]] = [
        ("train", {"stage": 1, "schedule": "1f1b"}), ("train", {"stage": 3, "schedule": "gpipe"}),
        ("train", {"stage": 1, "schedule": "interleaved_1f1b", "chunks": 2}),
        ("refusals", {}), ("checkpoint", {"root": str(tmp_path / "checkpoint")}),
        # tensor 2 x data 4 without a pipeline: MiCS and hpZ groups inside the data axis
        ("hybrid", {"stage": 1, "zero": {"mics_shard_size": 2}}), ("hybrid", {"stage": 3, "zero": {"mics_shard_size": 2}}),
        ("hybrid", {"stage": 3, "zero": {"zero_hpz_partition_size": 2}})]
    check_family(cases, run_family(PP * TP * DP, cases, WORKERS), CHECKS, world=PP * TP * DP)
