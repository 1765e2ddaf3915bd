"""Tensor parallelism the model brings itself, through ``initialize(mpu=...)``, at every ZeRO stage.

One world of 4 ranks (tensor 2 x data 2) runs every case: a Megatron-style block written here as user
code writes it (a column-parallel linear, then a row-parallel one, whose forward and backward
all-reduce over the tensor-parallel group through an autograd function), with a replicated layer norm
and bias, trained with gradient clipping active against one process training the unsplit block on the
global batch; a checkpoint saved and loaded at the same layout; and the refused inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard.distributed.model_parallel import MpuProtocolError
from zeroshard.engine.tensor_parallel import TensorParallelCheckpointError
from zeroshard.tools.testing import check_family, run_family

D, H, MICRO, ACCUM, STEPS, LR, WD, CLIP, TP = 6, 8, 2, 2, 5, 1e-2, 0.1, 0.05, 2


class TensorParallelMpu:
    """A user's mpu: tensor-parallel ranks consecutive (Megatron's order), DeepSpeed's and Megatron's names."""

    def __init__(self, tp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.dp, self.rank = tp, world // tp, rank
        self.tensor_group = self.data_group = None
        for d in range(self.dp):
            group = dist.new_group([d * tp + t for t in range(tp)])
            if rank // tp == d:
                self.tensor_group = group
        for t in range(tp):
            group = dist.new_group([d * tp + t for d in range(self.dp)])
            if rank % tp == t:
                self.data_group = group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.rank % self.tp

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_tensor_model_parallel_group(self) -> Any:
        return self.tensor_group

    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_group = get_tensor_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.rank // self.tp

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self) -> Any:
        return self.data_group


class CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the input's gradient is summed over the tensor-parallel ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """The partial outputs summed over the tensor-parallel ranks; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def split(param: torch.Tensor) -> nn.Parameter:
    """A parameter marked as Megatron marks the ones it splits."""
    out = nn.Parameter(param.detach().clone())
    setattr(out, "tensor_model_parallel", True)
    return out


class Block(nn.Module):
    """LayerNorm -> column-parallel linear -> GELU -> row-parallel linear (+ replicated bias), residual.
    ``group=None``: the unsplit block of one process."""

    def __init__(self, full: Optional["Block"] = None, tp: int = 1, rank: int = 0, group: Any = None) -> None:
        super().__init__()
        self.group = group
        self.norm = nn.LayerNorm(D)
        if full is None:
            self.w1, self.b1 = nn.Parameter(torch.randn(H, D) * 0.5), nn.Parameter(torch.randn(H) * 0.1)
            self.w2, self.b2 = nn.Parameter(torch.randn(D, H) * 0.5), nn.Parameter(torch.randn(D) * 0.1)
            return
        cols = slice(rank * H // tp, (rank + 1) * H // tp)
        self.norm.load_state_dict(full.norm.state_dict())
        self.w1, self.b1 = split(full.w1[cols]), split(full.b1[cols])
        self.w2, self.b2 = split(full.w2[:, cols]), nn.Parameter(full.b2.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.group is not None:
            h = CopyToTensorParallel.apply(h, self.group)
        partial = nn.functional.linear(nn.functional.gelu(nn.functional.linear(h, self.w1, self.b1)), self.w2)
        if self.group is not None:
            partial = ReduceFromTensorParallel.apply(partial, self.group)
        return x + partial + self.b2


def micro_batch(step: int, j: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * j + d)
    return torch.randn(MICRO, D, generator=g), torch.randn(MICRO, D, generator=g)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def config(stage: int) -> dict[str, Any]:
    return {"train_batch_size": MICRO * ACCUM * 2, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": {"stage": stage}}


def build(mpu: TensorParallelMpu, stage: int, seed: int = 0) -> tuple[Any, Block, Block]:
    """This rank's part of the block (from the unsplit block of ``seed``), wrapped; and the unsplit block."""
    torch.manual_seed(seed)
    full = Block()
    part = Block(full, mpu.tp, mpu.get_tensor_model_parallel_rank(), mpu.tensor_group)
    engine, _, _, _ = zeroshard.initialize(model=part, model_parameters=part.parameters(), config=config(stage),
                                           mpu=mpu)
    return engine, part, full


def train_step(engine: Any, step: int, data_rank: int) -> float:
    total = 0.0
    for j in range(ACCUM):
        x, y = micro_batch(step, j, data_rank)
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        total += float(loss.detach()) / ACCUM
    return total


def reference_step(full: Block, optimizer: torch.optim.Optimizer, step: int) -> tuple[float, float]:
    """One step of the unsplit block over the global batch: its mean loss and gradient norm."""
    total = 0.0
    for j in range(ACCUM):
        for d in range(2):
            x, y = micro_batch(step, j, d)
            loss = loss_of(full(x), y)
            (loss / (ACCUM * 2)).backward()
            total += float(loss.detach()) / (ACCUM * 2)
    norm = float(torch.nn.utils.clip_grad_norm_(full.parameters(), CLIP))
    optimizer.step()
    optimizer.zero_grad()
    return total, norm


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def part_values(part: Block) -> dict[str, torch.Tensor]:
    params = list(part.parameters())
    with zeroshard.GatheredParameters(params):
        return {name: p.detach().clone() for name, p in part.named_parameters()}


def expected_part(full: Block, tensor_rank: int) -> dict[str, torch.Tensor]:
    cols = slice(tensor_rank * H // TP, (tensor_rank + 1) * H // TP)
    return {"norm.weight": full.norm.weight, "norm.bias": full.norm.bias, "w1": full.w1[cols],
            "b1": full.b1[cols], "w2": full.w2[:, cols], "b2": full.b2}


def train_worker(rank: int, world: int, root: str, stage: int) -> dict[str, Any]:
    mpu = TensorParallelMpu(TP)
    engine, part, full = build(mpu, stage)
    reference = torch.optim.AdamW(full.parameters(), lr=LR, weight_decay=WD)
    data_rank = mpu.get_data_parallel_rank()
    losses, norms = [], []
    for step in range(STEPS):
        got = train_step(engine, step, data_rank)
        want, norm = reference_step(full, reference, step)
        losses.append((got, want))
        norms.append((engine.get_global_grad_norm(), norm))
    values = part_values(part)
    errors = {name: relative(values[name], want.detach())
              for name, want in expected_part(full, mpu.get_tensor_model_parallel_rank()).items()}
    # a checkpoint at the same layout: a fresh engine that loads it takes the next step as this one does
    engine.save_checkpoint(root, tag="ckpt")
    train_step(engine, STEPS, data_rank)
    after = part_values(part)
    engine.close()
    resumed, resumed_part, _ = build(mpu, stage, seed=1)
    resumed.load_checkpoint(root)
    train_step(resumed, STEPS, data_rank)
    resumed_after = part_values(resumed_part)
    resumed.close()
    parts = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
    return {"losses": losses, "norms": norms, "errors": errors, "parts": parts,
            "resumed": max(relative(resumed_after[n], after[n]) for n in after)}


def check_train(by_rank: list[dict[str, Any]], root: str, stage: int) -> None:
    for step in range(STEPS):  # each data-parallel rank's loss is its own samples'
        got = sum(out["losses"][step][0] for out in by_rank) / len(by_rank)
        want = by_rank[0]["losses"][step][1]
        assert abs(got - want) <= 1e-5 * abs(want), (step, [out["losses"][step] for out in by_rank])
    for rank, out in enumerate(by_rank):
        for got, want in out["norms"]:
            assert want > CLIP and abs(got - want) <= 1e-5 * want, (rank, out["norms"])  # clipping is active
        assert max(out["errors"].values()) <= 1e-5, (rank, out["errors"])
        assert out["parts"] == ["mp_rank_00", "mp_rank_01"], out["parts"]
        assert out["resumed"] <= 1e-6, (rank, out["resumed"])


class HalfAnMpu:
    def get_data_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_rank(self) -> int:
        return 0


def refusals_worker(rank: int, world: int, root: str) -> list[str]:
    errors = []
    try:
        zeroshard.initialize(model=nn.Linear(2, 2), config=config(0), mpu=HalfAnMpu())
    except MpuProtocolError as error:
        errors.append(str(error))
    engine, _, _ = build(TensorParallelMpu(TP), 1)
    engine.save_checkpoint(root, tag="t2")
    engine.close()
    wider = TensorParallelMpu(4)
    torch.manual_seed(0)
    part = Block(Block(), 4, wider.get_tensor_model_parallel_rank(), wider.tensor_group)
    cfg = {**config(1), "train_batch_size": MICRO * ACCUM}
    engine, _, _, _ = zeroshard.initialize(model=part, config=cfg, mpu=wider)
    try:
        engine.load_checkpoint(root)
    except TensorParallelCheckpointError as error:
        errors.append(str(error))
    engine.close()
    return errors


def check_refusals(by_rank: list[list[str]], root: str) -> None:
    for errors in by_rank:
        assert len(errors) == 2, errors
        for method in ("get_data_parallel_world_size", "get_data_parallel_group", "get_model_parallel_world_size",
                       "get_model_parallel_group"):
            assert method in errors[0], errors[0]
        assert "tensor parallel 4" in errors[1] and "mp_rank_01" in errors[1], errors[1]


WORKERS = {"train": train_worker, "refusals": refusals_worker}
CHECKS = {"train": check_train, "refusals": check_refusals}


def test_tensor_parallel_matches_one_process(tmp_path: Path) -> None:
    cases = [("train", {"stage": stage}) for stage in (0, 1, 2, 3)] + [("refusals", {})]
    check_family(cases, run_family(4, cases, WORKERS, root=tmp_path), CHECKS, world=4, root=tmp_path)
