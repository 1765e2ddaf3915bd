"""bf16 and fp16 against an fp32 DistributedDataParallel + AdamW reference; loss scaling; memory.

[Note: the stated tolerances]
A 16-bit run cannot match fp32 to rounding: its forward and backward compute in 8 (bf16) or 11 (fp16)
mantissa bits.  Over 50 steps of the test GPT (lr 1e-3, clipping active, losses about 4.1) we require:
- ``deviation``: ||ours - ref|| / ||ref - start|| over all parameters, i.e. how far the 16-bit run
  ended from the fp32 run, relative to how far training moved the weights: <= 0.06 (bf16), 0.01 (fp16);
- every step's loss within 2e-3 (bf16) or 6e-4 (fp16) of the reference's, on every rank.
Measured at stages 0-3, worlds 2 and 3: deviation 0.026-0.030 (bf16) and 0.0029-0.0044 (fp16); loss
differences at most 7.7e-4 (bf16) and 8.0e-5 (fp16) on the host of the first sessions, 3.0e-4 (fp16,
world 2, every stage alike) on an AMD EPYC host with AVX2 only: torch's CPU kernels for 16-bit types
round differently from one instruction set to another.  The bounds are about twice the largest.  A bug in the
mixed-precision path fails them by far: an update without unscaling moves the weights by the loss
scale, a missed clip (norms are ~20x the 0.05 threshold) or a stale master gives deviations near 1.
"""

from __future__ import annotations

import copy

import pytest
import torch
import zeroshard
from zs_common import make_model, rank_micro_batches, train_ddp, zero_config

from zeroshard.planning.estimator import EstimateRequest, estimate_stage
from zeroshard.precision import LossScaleError
from zeroshard.tools.testing import run_world

STEPS = 50
DEVIATION_TOL = {"bf16": 0.06, "fp16": 0.01}
LOSS_TOL = {"bf16": 2e-3, "fp16": 6e-4}


def ddp_losses(model: torch.nn.Module, rank: int, world: int, steps: int) -> list[float]:
    """The reference's per-step loss (mean over the micro batch of this rank, as the engine logs it)."""
    losses: list[float] = []
    train_ddp(model, rank, world, steps, 2, 1, losses=losses)
    return losses


def mixed_config(stage: int, dtype: str, **extra) -> dict:
    cfg = zero_config(stage, 2, 1, stage3_param_persistence_threshold=20)
    cfg[dtype] = {"enabled": True}
    cfg.update(extra)
    return cfg


# Other paths through the gradient dtypes: all-reduce instead of reduce-scatter (the own chunk is read
# from the bucket converted to bf16), fp32 communication, and fp32 gradients (the default holds bf16 ones
# with one micro step per optimizer step).
VARIANTS = {
    "": {},
    "all_reduce": {"zero_optimization": {"reduce_scatter": False}},
    "fp32_comm": {"communication_data_type": "fp32"},
    "fp32_accum": {"data_types": {"grad_accum_dtype": "fp32"}},
}


def follow_worker(rank: int, world: int, stage: int, variant: str = "") -> dict:
    ref = make_model()
    start = copy.deepcopy(ref)
    ref_losses = ddp_losses(ref, rank, world, STEPS)
    out = {}
    for dtype in ("bf16", "fp16") if not variant else ("bf16",):
        model = copy.deepcopy(start)
        config = mixed_config(stage, dtype)
        for key, value in VARIANTS[variant].items():
            config[key] = {**config[key], **value} if isinstance(value, dict) and key in config else value
        engine, _, _, _ = zeroshard.initialize(model=model, config=config)
        losses = []
        for step in range(STEPS):
            for x, y in rank_micro_batches(step, rank, world, 2, 1):
                loss = engine(x, y)
                assert loss.dtype == torch.float32 and engine.module.head.weight.dtype == engine.flat.dtype
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
        with zeroshard.GatheredParameters(list(model.parameters())):
            off = sum(float((a.detach().float() - b.detach()).pow(2).sum())
                      for a, b in zip(model.parameters(), ref.parameters()))
        moved = sum(float((b.detach() - c.detach()).pow(2).sum()) for b, c in zip(ref.parameters(), start.parameters()))
        out[dtype] = {"deviation": (off / moved) ** 0.5, "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                      "skipped": engine.skipped_steps, "dtype": str(engine.flat.dtype)}
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_and_fp16_follow_fp32_ddp(stage: int, world: int) -> None:
    check_follow(stage, world, "")


def check_follow(stage: int, world: int, variant: str) -> None:
    for result in run_world(follow_worker, world, args=(stage, variant)):
        for dtype, r in result.items():
            assert r["dtype"] == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype]
            what = f"{dtype} stage {stage} world {world} {variant}"
            assert r["deviation"] <= DEVIATION_TOL[dtype], f"{what}: deviation {r['deviation']:.4f}"
            assert r["loss_diff"] <= LOSS_TOL[dtype], f"{what}: loss off by {r['loss_diff']:.2e}"
            assert r["skipped"] == 0


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("variant", ["all_reduce", "fp32_comm", "fp32_accum"])
@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_gradient_dtype_variants_follow_fp32_ddp(stage: int, variant: str) -> None:
    check_follow(stage, 3, variant)


def snapshot(engine) -> dict:
    """Everything a skipped step must leave untouched."""
    state = {f"{b.index}.{k}": v for b in engine.strategy.layout.buckets
             for part in engine.updater.read_bucket(b)[1:] for k, v in part.items()}
    return {"masters": engine.strategy.masters.data.clone(), "params": engine.flat.data.clone(),
            "state": state, "lr": engine.get_lr()[0], "sched": engine.lr_scheduler.last_epoch}


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["masters"], b["masters"]) and torch.equal(a["params"], b["params"])
            and a["state"].keys() == b["state"].keys()
            and all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
            and a["lr"] == b["lr"] and a["sched"] == b["sched"])


def overflow_worker(rank: int, world: int) -> list[dict]:
    """An inf in rank 1's loss at step 3 only: every rank must skip that step, and only that one."""
    out = []
    for stage, fp16 in [(0, {}), (1, {}), (2, {"hysteresis": 1}), (3, {"hysteresis": 1}),
                        (2, {"loss_scale": 128})]:
        cfg = mixed_config(stage, "fp16", scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}})
        cfg["fp16"].update(fp16)
        engine, _, _, _ = zeroshard.initialize(model=make_model(), config=cfg)
        record = {"stage": stage, "fp16": fp16, "scales": [], "untouched": None}
        for step in range(6):
            before = snapshot(engine) if step == 3 else None
            for x, y in rank_micro_batches(step, rank, world, 2, 1):
                loss = engine(x, y)
                if step == 3 and rank == 1:
                    loss = loss * float("inf")
                engine.backward(loss)
                engine.step()
            if before is not None:
                record["untouched"] = same(before, snapshot(engine))
            record["scales"].append(engine.loss_scaler.scale)
        record["skipped"], record["global_steps"] = engine.skipped_steps, engine.global_steps
        out.append(record)
    return out


def test_inf_on_one_rank_skips_the_step_on_every_rank() -> None:
    for rank_records in run_world(overflow_worker, 2):
        for r in rank_records:
            assert r["untouched"], f"stage {r['stage']} {r['fp16']}: the skipped step changed the state"
            assert r["skipped"] == 1 and r["global_steps"] == 6
            if "loss_scale" in r["fp16"]:
                assert r["scales"] == [128.0] * 6  # static: the scale never moves
            elif r["fp16"].get("hysteresis") == 1:
                assert r["scales"] == [65536.0] * 3 + [32768.0] * 3  # halved at once
            else:
                assert r["scales"] == [65536.0] * 6  # hysteresis 2 absorbs one overflow


def min_scale_worker(rank: int, world: int) -> str:
    cfg = mixed_config(2, "fp16")
    cfg["fp16"].update({"initial_scale_power": 2, "min_loss_scale": 1, "hysteresis": 1})
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=cfg)
    for step in range(10):
        for x, y in rank_micro_batches(step, rank, world, 2, 1):
            loss = engine(x, y)
            engine.backward(loss * float("nan") if rank == 0 else loss)
            try:
                engine.step()
            except LossScaleError as err:
                return f"{engine.skipped_steps} {err}"
    return "no error"


def test_overflow_at_min_scale_is_an_error_on_every_rank() -> None:
    for message in run_world(min_scale_worker, 2):
        # scale 4 -> 2 -> 1 (two skipped steps), then an overflow at the minimum: the third step stops.
        assert message.startswith("2 step 3: gradients overflowed again at the minimum loss scale 1 "
                                  "(fp16.min_loss_scale)"), message


def scaler_checkpoint_worker(rank: int, world: int, directory: str) -> dict:
    """Train fp16 with an overflow, save, go on; a fresh engine loading the save must go on identically."""
    def run(engine, steps: range) -> None:
        for step in steps:
            for x, y in rank_micro_batches(step, rank, world, 2, 1):
                loss = engine(x, y)
                engine.backward(loss * float("inf") if step == 1 and rank == 0 else loss)
                engine.step()

    cfg = mixed_config(2, "fp16")
    cfg["fp16"].update({"hysteresis": 3, "loss_scale_window": 2})
    first, _, _, _ = zeroshard.initialize(model=make_model(), config=cfg)
    run(first, range(4))
    first.save_checkpoint(directory)
    saved = first.loss_scaler.state_dict()
    run(first, range(4, 7))
    second, _, _, _ = zeroshard.initialize(model=make_model(seed=5), config=cfg)
    second.load_checkpoint(directory)
    restored = second.loss_scaler.state_dict()
    run(second, range(4, 7))
    return {"saved": saved, "restored": restored, "skipped": (first.skipped_steps, second.skipped_steps),
            "equal": torch.equal(first.strategy.masters.data, second.strategy.masters.data)
            and torch.equal(first.flat.data, second.flat.data),
            "scales": (first.loss_scaler.scale, second.loss_scaler.scale)}


def test_loss_scaler_state_survives_a_checkpoint(tmp_path) -> None:
    for r in run_world(scaler_checkpoint_worker, 2, args=(str(tmp_path),)):
        # one overflow used one of 3 hysteresis units; 2 clean steps since then doubled the scale
        assert r["saved"] == {"scale": 131072.0, "dynamic": True, "hysteresis_left": 3, "clean_steps": 2}
        # (the scale then grows to 2**18, where step 7 overflows by itself, in both runs)
        assert r["restored"] == r["saved"] and r["skipped"] == (2, 2)
        assert r["equal"] and r["scales"][0] == r["scales"][1]


def memory_worker(rank: int, world: int, stage: int, dtype: str, accum: str | None) -> dict:
    model = make_model()
    cfg = mixed_config(stage, dtype)
    if accum:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
    for x, y in rank_micro_batches(0, rank, world, 2, 1):
        engine.backward(engine(x, y))
        engine.step()
    return {"mb": engine.memory_breakdown(), "psi": engine.strategy.layout.numel,
            "own": engine.strategy.layout.real_numel_in_shard(rank)}


@pytest.mark.parametrize("stage, world, dtype, accum", [
    (0, 3, "fp16", None), (1, 3, "bf16", None), (2, 3, "fp16", None), (3, 3, "bf16", "bf16"),
    (1, 2, "fp16", None), (2, 2, "bf16", "fp32"), (3, 2, "bf16", "fp32"),
])
@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_mixed_precision_memory_is_the_seed_formula(stage: int, world: int, dtype: str, accum) -> None:
    results = run_world(memory_worker, world, args=(stage, dtype, accum))
    psi = results[0]["psi"]
    g = 4 if accum == "fp32" else 2  # one micro step: bf16 gradients by default (DeepSpeed's under ZeRO)
    total = 0.0
    for r in results:
        mb, own = r["mb"], r["own"]
        assert mb["params"] == 2 * (own if stage == 3 else psi)
        assert mb["grads"] == g * (own if stage >= 2 else psi)
        assert mb["optimizer"] == 12 * (psi if stage == 0 else own)  # fp32 masters + Adam's two moments
        total += mb["model_states"]
    n = world
    if g == 2:  # the seeds' formulas
        formula = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]
    else:
        formula = {0: 18 * psi, 1: 6 * psi + 12 * psi / n, 2: 2 * psi + 16 * psi / n, 3: 18 * psi / n}[stage]
    assert total == pytest.approx(n * formula, rel=0, abs=1e-6)
    assert results[0]["mb"]["formula"] == pytest.approx(formula)
    # `zeroshard estimate` counts what the engine holds, fp32 gradients included
    assert estimate_stage(EstimateRequest(psi, n, "mixed", grad_bytes=g), stage).model_states == pytest.approx(total / n)


def gradient_dtype_worker(rank: int, world: int) -> dict:
    """Each stage twice from the same weights: the default gradient dtype and fp32 gradients."""
    out = {}
    for stage in (1, 2, 3):
        runs = {}
        for accum in (None, "fp32"):
            cfg = mixed_config(stage, "bf16")
            if accum:
                cfg["data_types"] = {"grad_accum_dtype": accum}
            engine, _, _, _ = zeroshard.initialize(model=make_model(), config=cfg)
            for step in range(3):
                for x, y in rank_micro_batches(step, rank, world, 2, 1):
                    engine.backward(engine(x, y))
                    engine.step()
            runs[accum] = {"dtype": engine.precision.grad_accum, "grads": engine.memory_breakdown()["grads"],
                           "masters": engine.strategy.masters.data.clone(), "params": engine.flat.data.clone(),
                           "norm": engine.get_global_grad_norm()}
        default, fp32 = runs[None], runs["fp32"]
        out[stage] = {"dtypes": (default["dtype"], fp32["dtype"]), "grads": (default["grads"], fp32["grads"]),
                      "norms": (default["norm"], fp32["norm"]),
                      "equal": torch.equal(default["masters"], fp32["masters"])
                      and torch.equal(default["params"], fp32["params"])}
    return out


def test_bf16_holds_bf16_gradients_without_accumulation_and_updates_as_fp32_ones() -> None:
    """With one micro step per optimizer step and a bf16 reduction, bf16 gradients hold exactly what fp32
    ones would (autograd's gradients are bf16, and so is what the ranks sum): the default keeps them in
    bf16, half the bytes, and three clipped steps at world 3 (padded chunks) end bitwise where fp32
    gradients end, at stages 1-3."""
    for result in run_world(gradient_dtype_worker, 3):
        for stage, r in result.items():
            assert r["dtypes"] == (torch.bfloat16, torch.float32), stage
            assert 2 * r["grads"][0] == r["grads"][1] > 0, stage
            assert r["norms"][0] == r["norms"][1], stage
            assert r["equal"], f"stage {stage}: bf16 gradients updated differently from fp32 ones"


def save_mixed_worker(rank: int, world: int, directory: str) -> None:
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=mixed_config(2, "bf16"))
    for step in range(3):
        for x, y in rank_micro_batches(step, rank, world, 2, 1):
            engine.backward(engine(x, y))
            engine.step()
    engine.save_checkpoint(directory)


def load_any_worker(rank: int, world: int, directory: str, stage: int, dtype: str) -> dict:
    config = mixed_config(stage, dtype) if dtype != "fp32" else zero_config(stage, 2, 1)
    engine, _, _, _ = zeroshard.initialize(model=make_model(seed=9), config=config)
    engine.load_checkpoint(directory)
    return {"state": engine.full_state_dict(), "masters": engine.strategy.masters is not None}


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_mixed_checkpoint_holds_fp32_masters_and_loads_into_any_precision(tmp_path) -> None:
    from safetensors.torch import load_file

    from zeroshard.checkpoint import consolidate

    run_world(save_mixed_worker, 2, args=(str(tmp_path / "ckpt"),))
    fp32 = load_file(str(consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors")))
    assert all(v.dtype == torch.float32 for v in fp32.values())
    for world, stage, dtype in ((3, 3, "fp32"), (1, 0, "bf16"), (2, 1, "fp16")):
        state = run_world(load_any_worker, world, args=(str(tmp_path / "ckpt"), stage, dtype))[0]["state"]
        target = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        for name, value in fp32.items():
            # the masters, exactly in fp32; rounded once into the 16-bit parameters of a mixed run
            assert torch.equal(state[name], value.to(target)), f"{name} after loading into {dtype} stage {stage}"
