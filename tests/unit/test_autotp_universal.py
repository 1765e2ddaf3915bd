"""AutoTP checkpoints in DeepSpeed's universal format, without DeepSpeed: a ZeRO-3 tensor-parallel
checkpoint joined across its tensor and data ranks, the join's rules (fused sub-parameters with per-rank
widths, uneven, replicated and row-parallel splits), a universal parameter cut back to one rank's slice,
and AutoTP's shard sizes."""

from __future__ import annotations

import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from zeroshard.checkpoint import consolidate
from zeroshard.checkpoint import constants as C
from zeroshard.checkpoint.deepspeed_format import DeepSpeedReader
from zeroshard.checkpoint.deepspeed_format.fragments import dump_fragment, group_per_tp_shapes, merge_zero_shards
from zeroshard.checkpoint.deepspeed_format.pickler import save_deepspeed_file, stand_in
from zeroshard.checkpoint.deepspeed_format.tp_layout import SubparamShape, TpConversionUnsupported, TpLayoutError
from zeroshard.checkpoint.deepspeed_format.tp_merge import merge_tp_slices
from zeroshard.checkpoint.deepspeed_format.tp_restore import autotp_slice, load_hp_checkpoint_state
from zeroshard.checkpoint.deepspeed_format.unpickle import load_deepspeed_file
from zeroshard.checkpoint.ds_to_universal import main
from zeroshard.deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from zeroshard.tensor_parallel.shard_sizes import AutoTPMeta, shard_size_list
from zeroshard.tools.cli import main as cli

# a fused q/k/v of 4 query and 2 + 2 key/value rows over 2 ranks whose heads split 3/1 and 1/1 (widths per
# sub-parameter, one entry per rank), 3 columns
SIZES, WIDTHS = (4, 2, 2), [[3, 1], [1, 1], [1, 1]]
FULL = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
META = {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4, "partition_dim": 0, "logical_shape": (8, 3),
        "sub_param_sizes": SIZES, "sub_param_shard_widths": WIDTHS, "replicated": False}
INFO = {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4, C.PARAMETER_WITH_SUB_PARAMS: [
    {"patterns": [r"^qkv\.weight$"], "shape": [SIZES, 3], "partition_dim": 0}],
    C.SUB_PARAM_SHARD_WIDTHS: {r"^qkv\.weight$": WIDTHS}, C.TP_REPLICATED_PARAMETER_PATTERNS: [r"^ln\.weight$"],
    C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"^proj\.weight$"]}


def with_meta(shape: tuple[int, ...], meta: dict) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(shape))
    setattr(param, C.DS_AUTOTP_UC_META, meta)
    return param


def rank_slices() -> list[torch.Tensor]:
    param = with_meta((4, 3), META)
    return [autotp_slice(param, FULL, rank, 2).view(-1, 3) for rank in range(2)]  # type: ignore[union-attr]


def test_a_fused_uneven_parameter_cut_per_rank_and_joined_back(tmp_path: Path) -> None:
    slices = rank_slices()
    assert [s.shape[0] for s in slices] == [5, 3]
    assert torch.equal(slices[1], FULL[[3, 5, 7]])  # each rank holds a piece of q, k and v
    for rank, piece in enumerate(slices):
        for state, scale in (("fp32", 1), ("exp_avg", 2), ("exp_avg_sq", 3)):
            dump_fragment(tmp_path / "work", rank, 0, state, piece.reshape(-1) * scale, "qkv.weight", 0, piece.numel())
    unused = merge_tp_slices(INFO, tmp_path / "zero", tmp_path / "work", 2, ("qkv.weight", [s.shape for s in slices]))
    assert unused == {r"^ln\.weight$", r"^proj\.weight$"}
    entry = load_deepspeed_file(tmp_path / "zero" / "qkv.weight" / "exp_avg.pt")  # DeepSpeed's class names only
    assert torch.equal(entry[C.PARAM], FULL * 2) and isinstance(entry[C.SUB_PARAM_SHAPE], SubparamShape)


def test_layouts_that_cannot_be_rebuilt_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TpConversionUnsupported, match="interleaved"):
        main(SimpleNamespace(input_folder=str(_stage3(tmp_path, {C.AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS:
                                                                 {"^qkv": "interleaved"}})),
                             output_folder=str(tmp_path / "u"), strict=True, keep_temp_folder=False))
    old = {**META, C.UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.0}  # no widths recorded: an even split only
    with pytest.raises(TpLayoutError, match="not divisible"):
        autotp_slice(with_meta((4, 3), old), FULL, 0, 4)
    uneven = {"partition_dim": 0, "logical_shape": (10, 2), "replicated": False}
    with pytest.raises(TpLayoutError, match="records no partition_sizes"):
        autotp_slice(with_meta((3, 2), uneven), torch.zeros(10, 2), 3, 4)
    assert torch.equal(autotp_slice(with_meta((3, 2), {**uneven, "partition_sizes": (3, 3, 2, 2)}),
                                    torch.arange(20.).view(10, 2), 3, 4), torch.arange(16., 20.))
    dump_fragment(tmp_path / "w", 0, 0, "fp32", torch.zeros(4), "p", 0, 4)
    with pytest.raises(TpLayoutError, match="not empty"):
        merge_zero_shards(tmp_path / "w" / "p", "fp32", 2, [(2, 2), (2, 2)])
    with pytest.raises(TpLayoutError, match="disagree on shape"):
        group_per_tp_shapes([{"w": (2, 4)}, {"w": (1, 4)}], pp_degree=2, tp_degree=1)


def _stage3(tmp_path: Path, info: dict) -> Path:
    """A ZeRO-3 checkpoint of tp 2 x dp 2: an uneven column split (5 rows: 3 + 2) and a replicated norm."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    weight, norm = torch.arange(20.).view(5, 4), torch.tensor([1., 2., 3.])
    for tp, rows in enumerate((slice(0, 3), slice(3, 5))):
        flat = torch.cat([weight[rows].reshape(-1), norm])
        shapes = [{"fc.weight": list(weight[rows].shape), "ln.weight": [3]}]
        per_param = [weight[rows].numel(), 3]
        for dp in range(2):
            # each parameter's dp partition: ceil(numel / 2) elements, the last rank's padded
            parts = [t[dp * -(-n // 2):(dp + 1) * -(-n // 2)] for t, n in zip(flat.split(per_param), per_param)]
            partition = torch.cat([torch.nn.functional.pad(p, (0, -(-n // 2) - p.numel()))
                                   for p, n in zip(parts, per_param)])
            optim = {C.OPTIMIZER_STATE_DICT: {"state": {0: {"exp_avg": partition * 10, "exp_avg_sq": partition}},
                                              C.PARAM_GROUPS: [{"lr": 0.1}]},
                     C.FP32_FLAT_GROUPS: [partition], C.ZERO_STAGE: 3}
            stem = folder / f"zero_pp_rank_{dp}_mp_rank_{tp:02d}"
            save_deepspeed_file({C.PARAM_SHAPES: shapes, C.UNIVERSAL_CHECKPOINT_INFO: info, "mp_world_size": 2},
                                Path(f"{stem}_model_states.pt"))
            save_deepspeed_file({C.OPTIMIZER_STATE_DICT: optim}, Path(f"{stem}_optim_states.pt"))
    return folder


def test_a_zero3_autotp_checkpoint_converts_and_reads_whole(tmp_path: Path) -> None:
    info = {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4, C.TP_REPLICATED_PARAMETER_PATTERNS: [r"^ln\.weight$"]}
    out = tmp_path / "universal"
    main(SimpleNamespace(input_folder=str(_stage3(tmp_path, info)), output_folder=str(out), strict=True,
                         keep_temp_folder=False))
    fc = load_deepspeed_file(out / "zero" / "fc.weight" / "exp_avg.pt")
    assert fc[C.CAT_DIM] == 0 and torch.equal(fc[C.PARAM], torch.arange(20.).view(5, 4) * 10)
    assert torch.equal(load_deepspeed_file(out / "zero" / "ln.weight" / "fp32.pt")[C.PARAM], torch.tensor([1., 2., 3.]))
    assert not (out / "tmp").exists() and (tmp_path / "latest_universal").read_text() == "universal"
    reader = DeepSpeedReader(out)  # the joined parameters, whole, for an engine of any tensor degree
    assert reader.stage == 3 and torch.equal(reader.read("fc.weight", "param"), torch.arange(20.))


def _stage1(tmp_path: Path) -> Path:
    """A ZeRO-1 checkpoint of tp 2 x dp 2: an uneven column split (5 rows: 3 + 2), a row-parallel weight
    (5 columns: 3 + 2) and a replicated norm, each rank's fragments placed by its param_slice_mappings."""
    folder = tmp_path / "ckpt1"
    folder.mkdir()
    fc, proj, norm = torch.arange(20.).view(5, 4), torch.arange(20.).view(4, 5) + 100, torch.tensor([1., 2., 3.])
    for tp, (rows, cols) in enumerate(((slice(0, 3), slice(0, 3)), (slice(3, 5), slice(3, 5)))):
        params = {"fc.weight": fc[rows], "proj.weight": proj[:, cols], "ln.weight": norm}
        flat = torch.cat([t.reshape(-1) for t in params.values()])
        per_rank = -(-flat.numel() // 2)
        model = {C.PARAM_SHAPES: [{k: v.shape for k, v in params.items()}], "mp_world_size": 2,
                 "module": params, C.UNIVERSAL_CHECKPOINT_INFO: {
                     C.UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4, C.TP_REPLICATED_PARAMETER_PATTERNS: [r"^ln\.weight$"],
                     C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"^proj\.weight$"]}}
        save_deepspeed_file(model, folder / f"mp_rank_{tp:02d}_model_states.pt")
        for dp in range(2):
            lo, hi = dp * per_rank, (dp + 1) * per_rank
            partition = torch.nn.functional.pad(flat[lo:hi], (0, hi - min(hi, flat.numel())))
            mappings, offset = {}, 0
            for name, t in params.items():
                start, end = max(offset, lo), min(offset + t.numel(), hi)
                if start < end:
                    mappings[name] = stand_in("deepspeed.utils.tensor_fragment.fragment_address",
                                              start=start - lo, numel=end - start)
                offset += t.numel()
            optim = {C.ZERO_STAGE: 1, C.PARAM_SLICE_MAPPINGS: [mappings],
                     C.SINGLE_PARTITION_OF_FP32_GROUPS: [partition],
                     C.BASE_OPTIMIZER_STATE: {"state": {0: {"exp_avg": partition * 10, "exp_avg_sq": partition,
                                                            "step": torch.tensor(3.)}},
                                              C.PARAM_GROUPS: [{"lr": 0.1, "params": [0]}]}}
            save_deepspeed_file({C.OPTIMIZER_STATE_DICT: optim},
                                folder / f"zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt")
    return folder


def test_a_zero1_autotp_checkpoint_converts(tmp_path: Path) -> None:
    out = tmp_path / "universal1"
    main(SimpleNamespace(input_folder=str(_stage1(tmp_path)), output_folder=str(out), strict=True,
                         keep_temp_folder=False))
    zero = out / "zero"
    fc = load_deepspeed_file(zero / "fc.weight" / "exp_avg.pt")
    proj = load_deepspeed_file(zero / "proj.weight" / "fp32.pt")
    assert fc[C.CAT_DIM] == 0 and torch.equal(fc[C.PARAM], torch.arange(20.).view(5, 4) * 10)
    assert proj[C.CAT_DIM] == 1 and torch.equal(proj[C.PARAM], torch.arange(20.).view(4, 5) + 100)
    assert torch.equal(load_deepspeed_file(zero / "ln.weight" / "fp32.pt")[C.PARAM], torch.tensor([1., 2., 3.]))
    assert load_deepspeed_file(zero / "fc.weight" / "step.pt") == 3
    assert load_deepspeed_file(zero / "optimizer_state.pt")[C.PARAM_GROUPS][0]["lr"] == 0.1
    # the folder read whole (latest_universal names it), as zeroshard's engine loads it
    assert cli(["convert", str(tmp_path), str(tmp_path / "zs")]) == 0
    consolidate(tmp_path / "zs", tmp_path / "model.safetensors")
    weights = load_file(tmp_path / "model.safetensors")
    assert torch.equal(weights["fc.weight"], torch.arange(20.).view(5, 4)) and weights["ln.weight"].shape == (3, )


def test_load_hp_checkpoint_state_fills_a_parameters_fragment(tmp_path: Path) -> None:
    param = with_meta((5, 3), META)
    hp = torch.zeros(6)  # this data-parallel rank's fragment: elements 6..11 of the rank-0 slice
    address = SimpleNamespace(start=6, numel=6)
    param._hp_mapping = SimpleNamespace(lp_fragment_address=address,  # type: ignore[attr-defined]
                                        get_hp_fragment=lambda: hp, optim_fragment=None)
    for state, scale in (("fp32", 1), ("exp_avg", 2)):
        torch.save({C.PARAM: FULL * scale}, tmp_path / f"{state}.pt")
    torch.save(torch.tensor(7.), tmp_path / "step.pt")
    step = types.MethodType(load_hp_checkpoint_state, param)(str(tmp_path), 0, 2)
    rank0 = rank_slices()[0].reshape(-1)
    assert step == 7 and torch.equal(hp, rank0[6:12])
    assert torch.equal(param._hp_mapping.optim_fragment["exp_avg"], rank0[6:12] * 2)  # type: ignore[attr-defined]


def test_optimizer_wrappers_keep_the_universal_info_of_their_parameters() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    setattr(param, C.UNIVERSAL_CHECKPOINT_INFO, {"k": 1})
    optimizer = object.__new__(BF16_Optimizer)
    optimizer.bf16_groups = [[param]]  # type: ignore[attr-defined]
    optimizer._enable_universal_checkpoint()  # type: ignore[attr-defined]
    delattr(param, C.UNIVERSAL_CHECKPOINT_INFO)
    assert optimizer._get_universal_checkpoint_info() == {"k": 1}  # type: ignore[attr-defined]
    assert hasattr(param, "load_hp_checkpoint_state")


def test_autotp_shard_sizes() -> None:
    assert shard_size_list(10, 4) == [3, 3, 2, 2]  # the extra rows to the first ranks
    assert shard_size_list(96, 2, AutoTPMeta(num_kv_heads=3), "q_proj") == [64, 32]  # whole heads: 2 + 1
    assert shard_size_list(96, 2, AutoTPMeta(num_kv_heads=3), "mlp.up_proj") == [48, 48]
    assert shard_size_list(10, 2, AutoTPMeta(tp_grain_size=4)) == [4, 6]  # 2 grains, the tail to the last rank


def test_expert_parameters_are_cut_per_expert_parallel_rank(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.zeros(2, 3))  # 2 of 4 experts, each a row
    hp = torch.zeros(6)
    address = SimpleNamespace(start=0, numel=6)
    param._hp_mapping = SimpleNamespace(lp_fragment_address=address,  # type: ignore[attr-defined]
                                        get_hp_fragment=lambda: hp, optim_fragment=None)
    torch.save({C.PARAM: torch.arange(12.).view(4, 3), "is_expert_param": True, "ep_num_experts": 4},
               tmp_path / "fp32.pt")
    types.MethodType(load_hp_checkpoint_state, param)(str(tmp_path), 0, 1, ep_rank=1, ep_size=2)
    assert torch.equal(hp, torch.arange(6., 12.))
