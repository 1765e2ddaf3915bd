"""Correctness: zeroshard at stages 0-3, fp32 and bf16, one and two micro steps per optimizer step,
against plain PyTorch on the same global batch (one process computing it all, ``torch.optim.AdamW``)
and, with several ranks, against DistributedDataParallel.

[Note: how a case is measured]
Every run starts from the same weights and sees the same global batch at each step, split by rank
and then by micro step; clipping is on (its threshold is below the gradients' norm, so it acts).
fp32 runs are compared tensor by tensor, ``max|ours - ref| / max|ref|``, the worst tensor: rounding
alone (another summation order of the same numbers) stays below 1e-5, a wrong reduction, a missed
micro step or a stale shard is off by orders of magnitude.  A bf16 run cannot match fp32 to rounding,
so it is measured as tests/distributed/test_mixed_precision.py measures it: the ``deviation``
``||ours - ref|| / ||ref - start||`` (how far it ended from the fp32 run, relative to how far training
moved the weights) and the largest difference of a micro step's loss (averaged over the ranks), with
that file's bounds.  Part of a bf16 run's deviation is no error of training but bf16's rounding of
the weights themselves (a LayerNorm weight near 1 is held to about 0.004), which only the distance
the weights move dilutes: hence ``STEPS`` steps at that file's learning rate, enough for the
deviation to stay about half the bound, rather than fewer at a higher rate (where Adam's steps on
gradients that rounding flips make even fp32 runs part further than 1e-5).
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

import zeroshard

from ...distributed.world import World
from ..demo.model import GPT
from .memory import model_state_formula
from .ranks import reduce_values
from .sizes import PARITY_MODEL

STEPS = 20
MICRO_BATCH = 2
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.1, 0.05
STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16")
ACCUMULATIONS = (1, 2)

State = dict[str, torch.Tensor]


def start_model(device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(PARITY_MODEL).to(device)


def global_batch(step: int, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rows on every rank and every run (drawn on the CPU from the step's own seed)."""
    data = torch.randint(0, PARITY_MODEL.vocab_size, (rows, PARITY_MODEL.seq_len + 1),
                         generator=torch.Generator().manual_seed(1000 + step)).to(device)
    return data[:, :-1], data[:, 1:]


def rank_micro_batches(step: int, rank: int, world: int, accumulation: int,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s micro batches at ``step``: the global batch split by rank, then by micro step."""
    x, y = global_batch(step, MICRO_BATCH * accumulation * world, device)
    rows = MICRO_BATCH * accumulation
    xs, ys = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    return [(xs[m * MICRO_BATCH:(m + 1) * MICRO_BATCH], ys[m * MICRO_BATCH:(m + 1) * MICRO_BATCH])
            for m in range(accumulation)]


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def _state(model: nn.Module) -> State:
    return {name: p.detach().to("cpu", torch.float32, copy=True) for name, p in model.named_parameters()}


def one_process(start: GPT, world: int, accumulation: int, device: torch.device) -> tuple[State, list[float]]:
    """Plain PyTorch on the whole global batch: the weights after ``STEPS`` steps and each micro step's loss
    (over the rows every rank takes at that micro step: the mean of the ranks' losses)."""
    model = copy.deepcopy(start)
    optimizer = _adamw(model)
    losses = []
    rows = MICRO_BATCH * accumulation
    for step in range(STEPS):
        x, y = global_batch(step, rows * world, device)
        for m in range(accumulation):
            index = torch.cat([torch.arange(r * rows + m * MICRO_BATCH, r * rows + (m + 1) * MICRO_BATCH)
                               for r in range(world)]).to(device)
            loss = model(x[index], y[index])
            (loss / accumulation).backward()
            losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _state(model), losses


def ddp(start: GPT, world: World, accumulation: int) -> tuple[State, list[float]]:
    """DistributedDataParallel + AdamW on the same micro batches: the weights, and each micro step's loss
    averaged over the ranks."""
    from torch.nn.parallel import DistributedDataParallel

    model = copy.deepcopy(start)
    wrapped = DistributedDataParallel(model, device_ids=[world.device.index] if world.device.type == "cuda" else None)
    optimizer = _adamw(model)
    losses = []
    for step in range(STEPS):
        batches = rank_micro_batches(step, world.rank, world.world_size, accumulation, world.device)
        for m, (x, y) in enumerate(batches):
            with wrapped.no_sync() if m < accumulation - 1 else contextlib.nullcontext():
                loss = wrapped(x, y)
                (loss / accumulation).backward()
            losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = _state(model)
    del wrapped
    return state, [v / world.world_size for v in reduce_values(world, losses)]


def config(stage: int, precision: str, accumulation: int) -> dict[str, Any]:
    """Small buckets, so that every stage cuts the model into several of them."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": accumulation,
        "gradient_clipping": CLIP, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 5000,
                              "stage3_param_persistence_threshold": 20},
        # one rank (one GPU) still issues every collective it checks, each over itself
        "collectives_in_a_world_of_one": True,
    }
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def zeroshard_run(start: GPT, world: World, stage: int, precision: str, accumulation: int,
                  extra: Optional[dict[str, Any]] = None, steps: int = STEPS) -> tuple[State, list[float], float]:
    """zeroshard on the same micro batches (``extra``: more config blocks) for ``steps`` steps: the gathered
    weights, each micro step's loss averaged over the ranks, and the model-state bytes this rank holds."""
    model = copy.deepcopy(start)
    engine, _, _, _ = zeroshard.initialize(model=model, config={**config(stage, precision, accumulation),
                                                                **(extra or {})})
    losses = []
    for step in range(steps):
        for x, y in rank_micro_batches(step, world.rank, world.world_size, accumulation, world.device):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    held = float(engine.memory_breakdown()["model_states"])
    full = engine.full_state_dict(rank0_only=False)
    engine.close()
    names = [name for name, _ in start.named_parameters()]
    return {n: full[n].to(torch.float32) for n in names}, \
        [v / world.world_size for v in reduce_values(world, losses)], held


def max_rel_diff(ours: State, ref: State) -> float:
    """The worst tensor's ``max|ours - ref| / max|ref|``."""
    worst = 0.0
    for name, r in ref.items():
        scale = float(r.abs().max()) or 1.0
        worst = max(worst, float((ours[name] - r).abs().max()) / scale)
    return worst


def deviation(ours: State, ref: State, start: State) -> float:
    """``||ours - ref|| / ||ref - start||`` over all parameters."""
    off = sum(float((ours[n] - r).pow(2).sum()) for n, r in ref.items())
    moved = sum(float((r - start[n]).pow(2).sum()) for n, r in ref.items())
    return math.sqrt(off / moved) if moved else math.inf


def _compare(precision: str, ours: State, losses: list[float], ref: Optional[tuple[State, list[float]]],
             start: State) -> tuple[Optional[float], Optional[float]]:
    """(the case's figure against one reference, its largest loss difference); Nones without a reference."""
    if ref is None:
        return None, None
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref[1]))
    if precision == "fp32":
        return max_rel_diff(ours, ref[0]), loss_diff
    return deviation(ours, ref[0], start), loss_diff


def run_cases(world: World, say: Any = print) -> list[dict[str, Any]]:
    """Every case of stages x precisions x accumulations, each with its figures against one process
    and (several ranks) DDP, and its model-state bytes summed over the ranks beside the formula's."""
    start = start_model(world.device)
    start_state = _state(start)
    num_params = sum(p.numel() for p in start.parameters() if p.requires_grad)
    references: dict[int, tuple[tuple[State, list[float]], Optional[tuple[State, list[float]]]]] = {}
    for accumulation in ACCUMULATIONS:
        references[accumulation] = (one_process(start, world.world_size, accumulation, world.device),
                                    ddp(start, world, accumulation) if world.is_distributed else None)
    cases = []
    for stage in STAGES:
        for precision in PRECISIONS:
            for accumulation in ACCUMULATIONS:
                ours, losses, held = zeroshard_run(start, world, stage, precision, accumulation)
                single, ddp_ref = references[accumulation]
                vs_single, loss_single = _compare(precision, ours, losses, single, start_state)
                vs_ddp, loss_ddp = _compare(precision, ours, losses, ddp_ref, start_state)
                measured = reduce_values(world, [held])[0]
                formula = model_state_formula(stage, num_params, world.world_size, precision, accumulation)
                cases.append({
                    "stage": stage, "precision": precision, "accumulation": accumulation, "steps": STEPS,
                    "metric": "max_rel_diff" if precision == "fp32" else "deviation",
                    "vs_one_process": vs_single, "vs_ddp": vs_ddp,
                    "loss_diff": max(v for v in (loss_single, loss_ddp) if v is not None),
                    "model_states_sum": measured, "formula_sum": formula * world.world_size,
                    "num_params": num_params,
                })
                say(f"selftest: correctness stage {stage} {precision} accumulation {accumulation}: "
                    f"{cases[-1]['metric']} {vs_single:.2e}" + (f" (DDP {vs_ddp:.2e})" if vs_ddp is not None else ""))
    if world.is_distributed:
        dist.barrier(group=world.group)
    return cases
