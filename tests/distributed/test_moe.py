"""A model with an MoE layer (top-2, 4 experts, experts on every rank) trains like one process at every
ZeRO stage: one world of two ranks runs stages 0-3 against one process that routes each rank's batch
itself (routing, capacity and l_aux are per rank) and averages the losses (fp32, 1e-5 relative).  The
routing is deterministic (no random token selection, no noise); the optimizer groups come from
``split_params_into_different_moe_groups_for_optimizer``, so the expert group carries "moe" and "name"."""

from __future__ import annotations

import torch
from torch import nn

import zeroshard
from zeroshard.experts import MoE
from zeroshard.moe.utils import split_params_into_different_moe_groups_for_optimizer
from zeroshard.tools.testing import CaseFailures, case, run_world

VOCAB, WIDTH, ROWS, STEPS, LR, AUX = 16, 8, 12, 3, 1e-2, 0.01


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.moe = MoE(WIDTH, nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH)),
                       num_experts=4, k=2, capacity_factor=1.0, min_capacity=2, use_rts=False,
                       top2_2nd_expert_sampling=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        out, l_aux, _ = self.moe(h)
        return nn.functional.cross_entropy(self.head(torch.tanh(h + out)), y) + AUX * l_aux


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (ROWS,), generator=g), torch.randint(0, VOCAB, (ROWS,), generator=g)


def groups(model: nn.Module) -> list[dict]:
    return split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "weight_decay": 0.0})


def reference(world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MoEModel()
    opt = torch.optim.AdamW(groups(model), lr=LR, weight_decay=0.0)
    for step in range(STEPS):
        (sum(model(*batch(step, r)) for r in range(world)) / world).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trained(rank: int, stage: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MoEModel()
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=groups(model), config={
        "train_micro_batch_size_per_gpu": ROWS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 100},
        "collective_timeout": 60})
    for step in range(STEPS):
        engine.backward(engine(*batch(step, rank)))
        engine.step()
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    return state


def worker(rank: int, world: int) -> list[float]:
    expected = reference(world)
    out = []
    for stage in range(4):
        with case(model="moe", stage=stage, world=world, rank=rank):
            ours = trained(rank, stage)
            out.append(max(float((ours[k] - v).abs().max()) / (float(v.abs().max()) or 1.0)
                           for k, v in expected.items()))
    return out


def test_moe_model_trains_like_one_process_at_every_stage() -> None:
    by_rank = run_world(worker, 2, timeout=300)
    failures = CaseFailures()
    for rank, result in enumerate(by_rank):
        for stage, worst in enumerate(result):
            with failures.case(model="moe", stage=stage, world=2, rank=rank):
                assert worst <= 1e-5, f"off by {worst:.2e}"
    failures.raise_any()
