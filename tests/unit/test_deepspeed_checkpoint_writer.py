"""Checkpoints written in DeepSpeed's layout (zeroshard/checkpoint/deepspeed_format/writer.py), without DeepSpeed.

Written from DeepSpeed's own fixtures (tests/fixtures/deepspeed/) at the world size and stage DeepSpeed
saved them, the files hold what DeepSpeed's own hold, tensor for tensor.  zeroshard -> DeepSpeed's layout ->
zeroshard is bitwise at other world sizes and stages.  The files name only DeepSpeed's own globals.  What
real DeepSpeed 0.19.8 did with such files (tests/fixtures/deepspeed/check_written.py: at world 2, and its own
world-2 fixtures rewritten for world 3), including a model whose output layer's weight is its embedding's
(written once, named twice in ``shared_params``, as DeepSpeed's own save of it), is recorded in
written_by_zeroshard.json, checked here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from zeroshard.checkpoint.consolidate import open_reader
from zeroshard.checkpoint.deepspeed_format import DeepSpeedReader, deepspeed_directory
from zeroshard.checkpoint.deepspeed_format.convert import convert_deepspeed, convert_to_deepspeed
from zeroshard.checkpoint.deepspeed_format.unpickle import STAND_INS, load_deepspeed_file
from zeroshard.tools.cli import main as cli_main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"


def tensors(value: Any, where: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state, by its path."""
    if isinstance(value, torch.Tensor):
        return {where: value}
    if isinstance(value, dict):
        return {k: t for key, v in value.items() for k, t in tensors(v, f"{where}.{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: t for i, v in enumerate(value) for k, t in tensors(v, f"{where}[{i}]").items()}
    return {}


def stage3_valid(shapes: list[torch.Size], world: int, rank: int) -> torch.Tensor:
    """Which elements of a stage-3 rank's flat vector are parameters' (not their padding)."""
    keep = []
    for shape in shapes:
        piece = -(-shape.numel() // world)
        valid = min(piece, max(0, shape.numel() - rank * piece))
        keep += [True] * valid + [False] * (piece - valid)
    return torch.tensor(keep)


@pytest.mark.parametrize("case", ["zero1_fp32", "zero2_bf16", "zero3_fp32", "zero3_bf16", "tied_zero2_fp32", "tied_zero3_fp32", "tied_frozen_zero3_fp32"])
def test_files_hold_what_deepspeeds_own_hold(case: str, tmp_path: Path) -> None:
    """The fixture rewritten at its own world size and stage: every file DeepSpeed wrote is written,
    with the same tensors (flat partitions, their padding, moments, steps, module, frozen fragments)."""
    meta = json.loads((FIXTURES / case / "meta.json").read_text())
    source = FIXTURES / case / "checkpoint"
    target = convert_to_deepspeed(source, tmp_path, meta["world_size"], meta["stage"])
    theirs = source / meta["tag"]
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if meta["stage"] == 3 else "mp_rank_00_model_states.pt"
    shapes = [s for group in load_deepspeed_file(theirs / model_file)["param_shapes"] for s in group.values()]
    assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in theirs.iterdir())
    assert (tmp_path / "latest").read_text() == meta["tag"]
    for path in theirs.iterdir():
        mine_file, own_file = load_deepspeed_file(target / path.name), load_deepspeed_file(path)
        assert sorted(mine_file) == sorted(own_file), path.name
        for entry in ("shared_params", "param_shapes", "frozen_param_shapes", "buffer_names"):  # tied weights: once
            assert mine_file.get(entry) == own_file.get(entry), f"{path.name}: {entry}"
        if "module" in own_file:
            assert list(mine_file["module"]) == list(own_file["module"]), path.name
        inner = "optimizer_state_dict"
        if inner in own_file:
            assert sorted(mine_file[inner]) == sorted(own_file[inner]), path.name
        mine, own = tensors(mine_file), tensors(own_file)
        assert sorted(mine) == sorted(own), path.name
        rank = int(path.name.split("zero_pp_rank_")[1].split("_")[0]) if "zero_pp_rank_" in path.name else 0
        for key, value in own.items():
            if meta["stage"] == 3 and key.count(".") >= 2 and ("fp32_flat_groups" in key or "exp_avg" in key):
                valid = stage3_valid(shapes, meta["world_size"], rank)  # DeepSpeed's padding holds leftovers
                assert torch.equal(mine[key][valid], value[valid]), f"{path.name}: {key}"
                continue
            if key.startswith(".frozen_param_fragments.") and meta["stage"] == 3:  # DeepSpeed leaves the
                shape = own_file["frozen_param_shapes"][key.split(".", 2)[2]]  # padding uninitialised
                value = value[:max(0, shape.numel() - rank * value.numel())]
                assert torch.equal(mine[key][:value.numel()], value), f"{path.name}: {key}"
                continue
            assert mine[key].dtype == value.dtype and torch.equal(mine[key], value), f"{path.name}: {key}"
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(str(target / path.name))
        assert set(needed) <= set(STAND_INS), needed


@pytest.mark.parametrize("world, stage, dtype", [(3, 1, "fp32"), (1, 2, "bf16"), (3, 3, "bf16"), (4, 3, "fp32")])
def test_zeroshard_to_deepspeed_and_back_is_bitwise(world: int, stage: int, dtype: str, tmp_path: Path) -> None:
    ours = tmp_path / "zeroshard"
    convert_deepspeed(FIXTURES / "zero2_bf16" / "checkpoint", ours)
    target = convert_to_deepspeed(ours, tmp_path / "deepspeed", world, stage, dtype)
    with open_reader(ours) as source, DeepSpeedReader(target) as back:
        assert (back.world_size, back.stage, back.bf16) == (world, stage, dtype == "bf16")
        assert back.param_names() == source.param_names()
        for name in source.param_names():
            for key in ("param", "optim.exp_avg", "optim.exp_avg_sq"):
                assert torch.equal(back.read(name, key), source.read(name, key)), (name, key)
        assert back.scalar_state(0) == source.scalar_state(0)
        extra, extra_back = source.extra(), back.extra()
        assert sorted(extra) == sorted(extra_back)
        for name, value in extra.items():  # frozen weights in the training dtype, as DeepSpeed keeps them
            assert torch.equal(extra_back[name], value.to(extra_back[name].dtype)), name
        for key in ("engine", "lr_scheduler"):
            assert {k: v for k, v in back.data[key].items() if k != "micro_steps"} == \
                {k: v for k, v in source.data[key].items() if k != "micro_steps"}
        client = json.loads((FIXTURES / "zero2_bf16" / "meta.json").read_text())["client_state"]
        assert {k: back.client_state()[k] for k in client} == {k: source.data["client_state"][k] for k in client}


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = str(FIXTURES / "zero1_bf16" / "checkpoint")
    assert cli_main(["convert", source, str(tmp_path), "--to", "deepspeed", "--world-size", "3", "--stage", "2"]) == 0
    assert "3 ranks, ZeRO stage 2" in capsys.readouterr().out
    directory = deepspeed_directory(tmp_path, None)
    assert directory is not None and DeepSpeedReader(directory).stage == 2
    with pytest.raises(SystemExit, match="--world-size and --stage"):
        cli_main(["convert", source, str(tmp_path), "--to", "deepspeed"])


def test_real_deepspeed_loaded_what_zeroshard_wrote() -> None:
    """The outcome of check_written.py under real DeepSpeed (see its docstring)."""
    record = json.loads((FIXTURES / "written_by_zeroshard.json").read_text())
    assert record["deepspeed"] == "0.19.8" and record["world_size"] == 2
    tied = ["tied_zero1_fp32", "tied_zero2_fp32", "tied_zero3_fp32", "tied_zero2_bf16", "tied_frozen_zero2_fp32",
            "tied_frozen_zero3_fp32"]
    assert sorted(record["cases"]) == sorted([f"zero{s}_{p}" for s in (1, 2, 3) for p in ("fp32", "bf16")] + tied)
    for case, got in record["cases"].items():
        as_saved = got["model_file_as_deepspeed_saves"]  # DeepSpeed's own save of what it loaded
        assert all(as_saved["entries_equal"].values()) and as_saved["module_keys_equal"], case
        assert not as_saved["module_differing"], case
        if case in tied:  # the output layer's weight once in the partitions, under both names everywhere else
            assert as_saved["shared_params"] == {"head.weight": "embed.weight"}, case
            assert got["tied"] == {"still_tied_in_deepspeed": True, "zero_to_fp32_head_is_embedding": True}, case
            assert "head.weight" in got["zero_to_fp32_keys"], case
        if case == "tied_zero2_bf16":  # from the fp32 fixture: no DeepSpeed continuation of its own in bf16
            got = dict(got, losses_max_rel_diff_vs_deepspeed_own=0.0, weights_max_abs_diff_vs_deepspeed_own=0.0)
        assert got["loaded_tag"] == "written", case
        assert got["masters_bitwise"] and got["optimizer_state_as_written"] and not got["differing"], case
        assert got["counters"] == [3, 18, 0] and got["lr_scheduler"] == {"last_batch_iteration": 2}, case
        assert got["client_state_equal"] and got["zero_to_fp32_bitwise"], case
        assert got["losses_max_rel_diff"] <= 1e-6 and got["weights_max_abs_diff"] <= 1e-6, case
        assert got["losses_max_rel_diff_vs_deepspeed_own"] <= 1e-6, case
        assert got["weights_max_abs_diff_vs_deepspeed_own"] <= 1e-6, case
    resharded = record["resharded"]  # DeepSpeed's own world-2 fixtures as zeroshard rewrote them for world 3
    assert resharded["world_size"] == 3
    assert sorted(resharded["cases"]) == sorted([c for c in record["cases"] if c not in tied]
                                                + ["tied_zero2_fp32", "tied_zero3_fp32", "tied_frozen_zero3_fp32"])
    for case, got in resharded["cases"].items():
        assert got["loaded_tag"] == "step3" and got["masters_bitwise"] and got["zero_to_fp32_bitwise"], case
        assert got["counters"] == [5, 30, 0] and got["client_state_equal"], case  # after its 2 steps
        bf16 = case.endswith("bf16")  # 3 ranks sum in another order than 2
        assert got["mean_loss_max_rel_diff_vs_deepspeed_world_2"] <= (5e-3 if bf16 else 1e-6), case
        assert got["weights_max_abs_diff_vs_deepspeed_world_2"] <= (1e-3 if bf16 else 1e-6), case


def test_a_frozen_weight_under_two_names_is_described_once() -> None:
    """A frozen embedding that is also the output layer: the manifest maps the second name to the first
    (``frozen_tied_to``), which DeepSpeed's layout records in ``shared_params``."""
    import importlib.util

    from zeroshard.checkpoint.module_state import ModuleState

    spec = importlib.util.spec_from_file_location("ds_make_fixtures", FIXTURES / "make_fixtures.py")
    assert spec is not None and spec.loader is not None
    make_fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_fixtures)
    model = make_fixtures.TiedNet()
    every = list(model.named_parameters())  # the tied weight once
    assert ModuleState(model, [p for _, p in every], [n for n, _ in every]).describe().get("frozen_tied_to") is None
    model.embed.weight.requires_grad_(False)
    trained = every[1:]
    described = ModuleState(model, [p for _, p in trained], [n for n, _ in trained]).describe()
    assert described["frozen_tied_to"] == {"head.weight": "embed.weight"}
    assert "head.weight" not in described["trainable_of"]
