"""The self-test's FP8 case, where FP8 training is available (torchao installed; on CUDA a GPU with FP8
GEMMs): zeroshard's FP8 layers at stage 3, which gathers their weights in FP8, against one process
training the same converted model; the throughput section times stage 3 with FP8 beside stage 3
without.

[Note: the self-test's FP8 reference]
FP8 scales are dynamic, each taken over the tensors one GEMM sees, so the one-process reference runs
the global batch as the ranks see it: each rank's rows in a forward and backward of their own (the
loss divided by the world size), the gradients summed.  It then quantises as every rank does, and
the runs differ by the order of fp32 sums alone, so the case is held to the fp32 bound (max relative
difference) like the fp32 cases.  It trains fewer steps than they do: a weight that those sums move
across an e4m3 rounding boundary would change its quantised value by e4m3's spacing, and the more
steps, the likelier that is; a layer that ran in high precision or quantised the global batch at
once differs by e4m3's rounding within the first step, far beyond the bound.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ...distributed.world import World
from ..demo.model import GPT
from .memory import model_state_formula
from .parity import CLIP, LR, WEIGHT_DECAY, max_rel_diff, rank_micro_batches, start_model, zeroshard_run
from .ranks import reduce_values

#: steps of an FP8 case (see [Note: the self-test's FP8 reference])
STEPS = 3
#: the stages of the FP8 cases: stage 3 alone, whose FP8 gathers and layers are all of FP8's path (the
#: tests check each stage)
STAGES = (3,)
RECIPE = "tensorwise"


#: the CUDA compute capability of the first GPUs with FP8 GEMMs (Ada, Hopper)
FP8_CAPABILITY = (8, 9)


def fp8_unavailable(device: torch.device) -> Optional[str]:
    """Why FP8 training cannot run on ``device`` (torchao missing, a GPU without FP8 GEMMs), or None; the
    CPU build of torch runs FP8 GEMMs (without FP8 units)."""
    from ...fp8.recipes import torchao_float8

    try:
        torchao_float8()
    except ImportError as err:
        return str(err)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        return f"{torch.cuda.get_device_name(device)} has no FP8 GEMMs (compute capability 8.9 or later)"
    return None


def fp8_block() -> dict[str, Any]:
    return {"enabled": True, "recipe": RECIPE}


def _one_process(start: GPT, world: int, device: torch.device) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The reference of [Note: the self-test's FP8 reference]: its weights and each step's loss averaged
    over the ranks' rows."""
    from ...fp8 import convert

    model = copy.deepcopy(start)
    convert(model, RECIPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for rank in range(world):
            (x, y), = rank_micro_batches(step, rank, world, 1, device)
            loss = model(x, y)
            (loss / world).backward()
            total += float(loss.detach()) / world
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()}, losses


def run_fp8_cases(world: World, say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The FP8 cases in fp32 (parity.py's model, batches, optimizer and config), each measured as an fp32
    case is; none where FP8 is unavailable."""
    why = fp8_unavailable(world.device)
    if why is not None:
        say(f"selftest: no FP8 case ({why})")
        return []
    start = start_model(world.device)
    reference_state, reference_losses = _one_process(start, world.world_size, world.device)
    num_params = sum(p.numel() for p in start.parameters() if p.requires_grad)
    cases = []
    for stage in STAGES:
        ours, mean_losses, held = zeroshard_run(start, world, stage, "fp32", 1, extra={"fp8": fp8_block()},
                                                steps=STEPS)
        ours = {n: v.to("cpu") for n, v in ours.items()}
        cases.append({
            "stage": stage, "precision": "fp32", "fp8": RECIPE, "accumulation": 1, "steps": STEPS,
            "metric": "max_rel_diff", "vs_one_process": max_rel_diff(ours, reference_state), "vs_ddp": None,
            "loss_diff": max(abs(a - b) for a, b in zip(mean_losses, reference_losses)),
            "model_states_sum": reduce_values(world, [held])[0],
            "formula_sum": model_state_formula(stage, num_params, world.world_size, "fp32", 1) * world.world_size,
            "num_params": num_params,
        })
        say(f"selftest: correctness stage {stage} fp32 + FP8 ({RECIPE}): max_rel_diff "
            f"{cases[-1]['vs_one_process']:.2e}")
    if world.is_distributed:
        dist.barrier(group=world.group)
    return cases
