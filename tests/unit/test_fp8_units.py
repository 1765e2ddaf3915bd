"""FP8 linear layers (zeroshard/fp8/): the GEMMs against a reference that quantises with the same scales and
multiplies in fp64, a check that the GEMMs really ran in FP8, and the layer selection and its errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroshard.config import ConfigError, load_config
from zeroshard.errors import NotSupportedByZeroshard

fp8 = pytest.importorskip("zeroshard.fp8")
pytest.importorskip("torchao")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: the FP8 formats of (input, weight, grad_output) per recipe (docs/FP8.md, "Recipes")
FORMATS = {"tensorwise": (E4M3, E4M3, E5M2), "rowwise": (E4M3, E4M3, E4M3)}


def _dequantised(t: torch.Tensor, dtype: torch.dtype, dim: int | None, power_of_2: bool) -> torch.Tensor:
    """``t`` quantised to ``dtype`` with a dynamic scale (one per tensor, or one per slice along ``dim``, the
    GEMM's contraction dimension), and back in fp64: the FP8 value each element becomes."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    top = torch.finfo(dtype).max
    scale = (top / amax.double().clamp(min=1e-12)).float()
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (t.float() * scale).clamp(-top, top).to(dtype)
    return q.double() / scale.double()


def _reference_mm(a: torch.Tensor, b: torch.Tensor, formats: tuple[torch.dtype, torch.dtype], recipe: str,
                  power_of_2: bool) -> torch.Tensor:
    """a @ b with both operands quantised as the recipe does, multiplied in fp64; rowwise GEMMs give their
    product in bf16 (torch._scaled_mm's output for per-row scales)."""
    rowwise = recipe == "rowwise"
    product = _dequantised(a, formats[0], 1 if rowwise else None, power_of_2) @ \
        _dequantised(b, formats[1], 0 if rowwise else None, power_of_2)
    return product.float().bfloat16().float() if rowwise else product.float()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_equals_the_quantised_reference(recipe: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48, bias=False))
    fp8.convert(model, recipe)
    layer = model[0]
    x = torch.randn(32, 64, requires_grad=True)
    y = layer(x)
    go = torch.randn_like(y)
    y.backward(go)
    w = layer.weight.detach()
    i, wf, g = FORMATS[recipe]
    pow2 = layer.config.round_scales_to_power_of_2
    assert _relative(y, _reference_mm(x.detach(), w.t(), (i, wf), recipe, pow2)) <= 1e-6
    assert _relative(x.grad, _reference_mm(go, w, (g, wf), recipe, pow2)) <= 1e-6
    assert _relative(layer.weight.grad, _reference_mm(go.t(), x.detach(), (g, i), recipe, pow2)) <= 1e-6


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_every_gemm_takes_fp8_operands(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward and both backward GEMMs go through torch._scaled_mm with FP8 operands: a layer that fell
    back to a high-precision matmul would make no call here."""
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    scaled_mm = torch._scaled_mm

    def recording(a: torch.Tensor, b: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append((a.dtype, b.dtype))
        return scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    model = nn.Sequential(nn.Linear(32, 16).bfloat16())
    fp8.convert(model, recipe)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    model(x).sum().backward()
    i, w, g = FORMATS[recipe]
    assert seen == [(i, w), (g, w), (g, i)]


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wg = nn.Linear(32, 16, bias=False)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 10)
        self.gate = _Gate()
        self.lm_head = nn.Linear(64, 32)


def test_defaults_keep_head_router_and_odd_shapes() -> None:
    selection = fp8.convert(_Tiny())
    assert selection.converted == ("fc",)
    assert dict(selection.kept) == {"odd": "dimensions 64 x 10 are not multiples of 16",
                                    "gate.wg": "an MoE router", "lm_head": "an output head"}
    named = fp8.convert(_Tiny(), include=["fc", "lm_head"])
    assert named.converted == ("fc", "lm_head")


def test_a_whole_pipelines_selection_keeps_tied_layers() -> None:
    """A pipeline's selection (fp8/stages.py) runs over every stage's layers by global name: a pattern may
    match another stage's layer, and tied layers stay in high precision."""
    from zeroshard.fp8.selection import LinearShape, select

    shapes = [LinearShape("1.fc", 32, 64), LinearShape("2", 32, 32), LinearShape("5", 32, 64)]
    picked = select(shapes, exclude=["2"], kept_anyway={"5": "a tied layer"})
    assert picked.converted == ("1.fc",)
    assert dict(picked.kept) == {"2": "matches 'fp8.exclude'", "5": "a tied layer"}
    with pytest.raises(fp8.FP8ConfigError, match="converts no linear layer"):
        select(shapes[2:], kept_anyway={"5": "a tied layer"})


def test_bad_selections_are_named() -> None:
    with pytest.raises(fp8.FP8ConfigError, match="'fp8.include' pattern 'blocks.*' matches no nn.Linear"):
        fp8.convert(_Tiny(), include=["blocks.*"])
    with pytest.raises(fp8.FP8ConfigError, match="'fp8.exclude' pattern 'nope'"):
        fp8.convert(_Tiny(), exclude=["nope"])
    with pytest.raises(fp8.FP8ConfigError, match="converts no linear layer"):
        fp8.convert(_Tiny(), exclude=["fc"])
    with pytest.raises(fp8.FP8ConfigError, match="not a known FP8 recipe"):
        fp8.convert(_Tiny(), recipe="blockwise")


def test_config_block_is_checked() -> None:
    with pytest.raises(ConfigError, match="'fp8.recipe' = \"rowwize\" is not one of tensorwise, rowwise"):
        load_config({"fp8": {"enabled": True, "recipe": "rowwize"}})
    with pytest.raises(ConfigError, match="'fp8.enabled' with 'fp16.enabled'"):
        load_config({"fp8": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(ConfigError, match="'fp8.gather_weights_in_fp8' with 'zero_optimization.zero_hpz"):
        load_config({"fp8": {"enabled": True}, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}})
    assert load_config({"fp8": {"enabled": True, "recipe": "rowwise"}}).fp8.recipe == "rowwise"


def test_tensor_parallelism_is_refused() -> None:
    from zeroshard.fp8.checks import refuse_fp8_with
    with pytest.raises(NotSupportedByZeroshard, match="'fp8.enabled' with tensor parallelism"):
        refuse_fp8_with(2)
    refuse_fp8_with(1)


def test_fp8_gather_packs_weights_in_one_byte_and_the_rest_as_it_is() -> None:
    """Stage 3's FP8 gathers (sharding/stage3/fp8_gathers.py): a bucket of an FP8 weight, another parameter
    and padding, split over two ranks, packed and unpacked."""
    from zeroshard.sharding.layout import BucketLayout, ParamSlot
    from zeroshard.sharding.stage3.fp8_gathers import E4M3, Fp8BucketPlan, scales_of
    slots = (ParamSlot(0, "w", 0, 32, (4, 8)), ParamSlot(1, "b", 32, 6, (6,)))
    bucket = BucketLayout(0, 0, 0, 38, 40, slots, 2)
    plan = Fp8BucketPlan(bucket, {0}, torch.bfloat16.itemsize)
    assert plan.packed == 12 + 6 * 2 + 2  # rank 1: 12 weight bytes, 6 bf16 elements, 2 padding (rank 0: 20)
    full = torch.randn(40).bfloat16()
    full[38:] = 0
    scales = scales_of(full[:32].float().abs().max().reshape(1))
    into = torch.full((40,), float("nan"), dtype=torch.bfloat16)
    for rank in (0, 1):
        start, end = bucket.shard_range(rank)
        plan.unpack(plan.pack(full[start:end], rank, scales), rank, scales, into)
    weight = (full[:32].float() * scales[0]).to(E4M3).float() / scales[0]
    assert torch.equal(into[:32], weight.bfloat16())
    assert torch.equal(into[32:], full[32:])


def test_a_dequantised_weight_casts_back_to_the_gathered_fp8_values() -> None:
    """What FP8 gathers rely on: torchao's tensorwise cast of the dequantised weight finds the gathered
    scale and e4m3 values again ([Note: gathering FP8 weights in FP8] in sharding/stage3/fp8_gathers.py)."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from zeroshard.sharding.stage3.fp8_gathers import E4M3, scales_of
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        weight = (torch.randn(64, 48) * torch.logspace(-4, 1, 48)).to(dtype)
        scale = scales_of(weight.float().abs().max().reshape(1))[0]
        gathered = (weight.float() * scale).clamp(-448, 448).to(E4M3)
        dequantised = (gathered.float() / scale).to(dtype)
        cast = hp_tensor_to_float8_dynamic(dequantised, E4M3, LinearMMConfig())
        assert torch.equal(cast._scale, scale)
        assert torch.equal(cast._data.view(torch.uint8), gathered.view(torch.uint8))


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))


def _config() -> dict:
    return {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10}}


def test_accelerates_torchao_conversion_trains_and_its_fsdp2_weights_are_refused() -> None:
    """Hugging Face Accelerate's FP8 path converts with accelerate.utils.ao before calling initialize():
    without ``enable_fsdp_float8_all_gather`` the model trains; with it (Accelerate's default) it is refused
    by name."""
    import zeroshard
    from accelerate.utils.ao import convert_model_to_fp8_ao
    from torchao.float8 import Float8LinearConfig
    model = _mlp()
    convert_model_to_fp8_ao(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=False))
    assert fp8.fp8_layers(model) == ["2"]  # Accelerate keeps the first and last linear layers
    engine, _, _, _ = zeroshard.initialize(model=model, config=_config())
    loss = engine(torch.randn(4, 32)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.close()
    wrapped = _mlp()
    convert_model_to_fp8_ao(wrapped, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    with pytest.raises(NotSupportedByZeroshard, match="WeightWithDynamicFloat8CastTensor"):
        zeroshard.initialize(model=wrapped, config=_config())
