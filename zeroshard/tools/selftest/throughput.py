"""Throughput, memory and host syncs on the ``--size`` model: zeroshard stages 0-3 beside plain PyTorch
(DistributedDataParallel with several ranks) and FSDP2 (``fully_shard`` per block, then the root).

Every implementation starts from the same weights, trains on the same batches with fused AdamW and
runs ``warmup`` steps, then ``steps`` timed ones (tokens/s of the whole world, the slowest rank's
time), then ``COUNTED_STEPS`` under a :class:`~.syncs.SyncCounter` (see [Note: what counts as a host
sync] in tools/selftest/syncs.py).  The device's peak is taken over the timed steps (reset after the
warm-up, so that it is the steady state's, not the set-up's).  zeroshard's model-state bytes come
from ``engine.memory_breakdown()``, summed over the ranks.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable, Optional

import torch

import zeroshard

from ...distributed.world import World
from ..demo.model import GPT
from .fp8_case import RECIPE, fp8_block, fp8_unavailable
from .memory import device_estimate, model_state_formula
from .ranks import reduce_values, settle
from .sizes import Preset
from .syncs import SyncCounter

COUNTED_STEPS = 2
ADAMW: dict[str, Any] = {"lr": 1e-4, "weight_decay": 0.01, "fused": True}

Step = Callable[[torch.Tensor, torch.Tensor], None]


#: zeroshard's stage 3 with FP8 layers (its weights gathered in FP8), timed where FP8 is available
FP8_STAGE3 = "stage 3 + fp8"


def implementations(world: World) -> list[str]:
    fp8 = [FP8_STAGE3] if fp8_unavailable(world.device) is None else []
    return ["ddp" if world.is_distributed else "pytorch", "fsdp2", *(f"stage {s}" for s in range(4)), *fp8]


def _batches(preset: Preset, world: World, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for i in range(count):
        data = torch.randint(0, preset.model.vocab_size, (preset.micro_batch, preset.model.seq_len + 1),
                             generator=torch.Generator().manual_seed(100 * i + world.rank)).to(world.device)
        out.append((data[:, :-1], data[:, 1:]))
    return out


def _model(preset: Preset, device: torch.device) -> GPT:
    torch.manual_seed(0)
    with device:  # built where it trains: a big model is not first made on the CPU
        return GPT(preset.model)


def fsdp2_per_block(model: GPT, bf16: bool) -> GPT:
    """FSDP2 as its users wrap a GPT: ``fully_shard`` on each block and on the root (bf16: its
    mixed-precision policy, parameters and reductions in bf16)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 \
        else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _torch_step(name: str, model: GPT, world: World, precision: str) -> Step:
    """Plain PyTorch or DDP (autocast for bf16), or FSDP2 (its mixed-precision policy for bf16)."""
    bf16 = precision == "bf16"
    if name == "fsdp2":
        wrapped: torch.nn.Module = fsdp2_per_block(model, bf16)
    elif name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[world.device.index] if world.device.type == "cuda"
                                          else None)
    else:
        wrapped = model
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    autocast = bf16 and name != "fsdp2"

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(world.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = wrapped(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _zeroshard_step(engine: zeroshard.Engine) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.backward(engine(x, y))
        engine.step()
    return step


def _zeroshard_config(stage: int, preset: Preset, precision: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": preset.micro_batch, "steps_per_print": 10**9,
                           "optimizer": {"type": "AdamW", "params": {"lr": ADAMW["lr"],
                                                                     "weight_decay": ADAMW["weight_decay"]}},
                           "zero_optimization": {"stage": stage},
                           # one rank still runs the communication path it checks
                           "collectives_in_a_world_of_one": True}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def run_one(name: str, preset: Preset, world: World, precision: str, steps: int, warmup: int) -> dict[str, Any]:
    """One implementation: tokens/s, host syncs per step, the device's peak, and for zeroshard its
    model-state bytes with the formula and the device estimate beside them."""
    model = _model(preset, world.device)
    num_params = sum(p.numel() for p in model.parameters())
    engine: Optional[zeroshard.Engine] = None
    fp8 = name == FP8_STAGE3
    if name.startswith("stage"):
        config = _zeroshard_config(int(name.split()[1]), preset, precision)
        if fp8:
            config["fp8"] = fp8_block()
        engine, _, _, _ = zeroshard.initialize(model=model, config=config)
        step = _zeroshard_step(engine)
    else:
        step = _torch_step(name, model, world, precision)
    batches = _batches(preset, world, warmup + steps + COUNTED_STEPS)
    for x, y in batches[:warmup]:
        step(x, y)
    settle(world)
    if world.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(world.device)
    started = time.perf_counter()
    for x, y in batches[warmup:warmup + steps]:
        step(x, y)
    settle(world)
    elapsed = reduce_values(world, [time.perf_counter() - started], "max")[0]
    peak = reduce_values(world, [torch.cuda.max_memory_allocated(world.device)], "max")[0] \
        if world.device.type == "cuda" else None
    with SyncCounter(world.device) as counter:
        for x, y in batches[warmup + steps:]:
            step(x, y)
    settle(world)
    tokens = steps * preset.micro_batch * preset.model.seq_len * world.world_size
    record: dict[str, Any] = {
        "implementation": name, "tokens_per_s": tokens / elapsed, "step_s": elapsed / steps,
        "host_reads_per_step": counter.reads / COUNTED_STEPS, "counted_steps": COUNTED_STEPS,
        "host_read_sites": dict(counter.sites.most_common()),  # over the counted steps, by file:line
        "device_syncs_per_step": None if counter.device_syncs is None else counter.device_syncs / COUNTED_STEPS,
        "device_peak_bytes": peak, "num_params": num_params,
    }
    if fp8:  # timed beside stage 3; its model states are stage 3's (judged there)
        record.update(stage=3, fp8=RECIPE)
    elif engine is not None:
        record.update(_zeroshard_memory(engine, preset, world, precision, num_params))
    if engine is not None:
        engine.close()
    del model, engine, step
    gc.collect()
    if world.device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def _zeroshard_memory(engine: zeroshard.Engine, preset: Preset, world: World, precision: str,
                      num_params: int) -> dict[str, Any]:
    stage = engine.stage
    held = float(engine.memory_breakdown()["model_states"])
    zero = engine.config.zero_optimization
    return {
        "stage": stage, "model_states_rank0": held, "model_states_sum": reduce_values(world, [held])[0],
        "formula": model_state_formula(stage, num_params, world.world_size, precision, 1),
        "formula_sum": model_state_formula(stage, num_params, world.world_size, precision, 1) * world.world_size,
        "device_estimate": device_estimate(stage, num_params, world.world_size, precision, preset.model,
                                           preset.micro_batch, zero.reduce_bucket_size,
                                           zero.stage3_prefetch_bucket_size)
        if world.device.type == "cuda" else None,
    }


def run_all(preset: Preset, world: World, precision: str, steps: int, warmup: int,
            say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    records = []
    for name in implementations(world):
        try:
            record = run_one(name, preset, world, precision, steps, warmup)
        except ImportError as err:  # FSDP2 needs torch >= 2.6
            record = {"implementation": name, "unavailable": str(err)}
        records.append(record)
        if "tokens_per_s" in record:
            say(f"selftest: {name}: {record['tokens_per_s']:,.0f} tokens/s, "
                f"{record['host_reads_per_step']:g} host reads per step")
    timed = {r["implementation"]: r["tokens_per_s"] for r in records if "tokens_per_s" in r}
    if FP8_STAGE3 in timed and "stage 3" in timed:
        say(f"selftest: FP8 at stage 3: {timed[FP8_STAGE3] / timed['stage 3']:.2f}x stage 3's tokens/s ({precision})")
    return records
