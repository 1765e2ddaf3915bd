"""The fp16 loss scaler's update rule (see zeroshard/precision/loss_scaler.py [Note: dynamic loss scaling])."""

import pytest

from zeroshard.config import load_config
from zeroshard.precision import LossScaleError, LossScaler, PrecisionPolicy


def run(scaler: LossScaler, overflows: str) -> list[float]:
    """Feed a pattern ('x' overflow, '.' clean) and return the scale after each step."""
    scales = []
    for i, c in enumerate(overflows):
        scaler.update(c == "x", step=i + 1)
        scales.append(scaler.scale)
    return scales


def test_defaults_come_from_the_config_without_the_2_32_quirk() -> None:
    scaler = LossScaler.from_config(load_config({"fp16": {"enabled": True}}))
    assert (scaler.scale, scaler.window, scaler.hysteresis, scaler.min_scale) == (2.0 ** 16, 1000, 2, 1.0)
    assert scaler.dynamic and scaler.checks_overflow
    assert not LossScaler.from_config(load_config({"bf16": {"enabled": True}})).checks_overflow
    static = LossScaler.from_config(load_config({"fp16": {"enabled": True, "loss_scale": 64}}))
    assert (static.scale, static.dynamic, static.checks_overflow) == (64.0, False, True)
    assert run(static, "xx..x") == [64.0] * 5


def test_hysteresis_window_and_growth() -> None:
    scaler = LossScaler(scale=16, dynamic=True, window=3, hysteresis=2)
    # first overflow absorbed, second halves; it stays at 1 hysteresis until growth refills it
    assert run(scaler, "xx") == [16, 8]
    assert run(scaler, "x") == [4]
    assert run(scaler, "...") == [4, 4, 8]  # 3 clean steps: doubled, hysteresis refilled
    assert run(scaler, "x.x") == [8, 8, 4]


def test_consecutive_hysteresis_refills_after_every_clean_step() -> None:
    scaler = LossScaler(scale=16, dynamic=True, window=100, hysteresis=2, consecutive_hysteresis=True)
    assert run(scaler, "x.x.x.") == [16] * 6  # every overflow absorbed
    assert run(scaler, "xx") == [16, 8]


def test_overflow_at_the_minimum_is_an_error() -> None:
    scaler = LossScaler(scale=4, dynamic=True, hysteresis=1, min_scale=2)
    assert run(scaler, "x") == [2]
    with pytest.raises(LossScaleError, match="step 1: gradients overflowed again at the minimum loss scale 2"):
        scaler.update(True, step=1)


def test_precision_policy_defaults() -> None:
    import torch

    assert PrecisionPolicy.from_config(load_config({})) == PrecisionPolicy()
    bf16 = PrecisionPolicy.from_config(load_config({"bf16": {"enabled": True}}))
    # nothing accumulates and the reduction is bf16: bf16 gradients, DeepSpeed's default under ZeRO
    assert (bf16.compute, bf16.comm, bf16.grad_accum) == (torch.bfloat16, torch.bfloat16, torch.bfloat16)

    def bf16_accum(**config) -> torch.dtype:
        return PrecisionPolicy.from_config(load_config({"bf16": {"enabled": True}, **config})).grad_accum

    assert bf16_accum(gradient_accumulation_steps=1, train_micro_batch_size_per_gpu=2) == torch.bfloat16
    assert bf16_accum(gradient_accumulation_steps=4, train_micro_batch_size_per_gpu=2) == torch.float32
    assert bf16_accum(communication_data_type="fp32") == torch.float32
    assert bf16_accum(gradient_accumulation_steps=4, data_types={"grad_accum_dtype": "bf16"}) == torch.bfloat16
    assert bf16_accum(data_types={"grad_accum_dtype": "fp32"}) == torch.float32
    fp16 = PrecisionPolicy.from_config(load_config({"fp16": {"enabled": True}, "communication_data_type": "fp32"}))
    assert (fp16.compute, fp16.comm, fp16.grad_accum) == (torch.float16, torch.float32, torch.float16)
