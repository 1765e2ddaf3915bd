"""DeepSpeed's checkpoint API under zeroshard (``deepspeed.checkpoint``), without DeepSpeed: universal
checkpoints written (``ds_to_universal``) and read, ``DeepSpeedCheckpoint``, the file-name helpers and the
constants module DeepSpeed's ``zero_to_fp32.py`` imports.

The fixtures are real DeepSpeed 0.19.8 checkpoints (tests/fixtures/deepspeed/).  What real DeepSpeed's own
``ds_to_universal`` wrote for the same fixtures, compared file by file with zeroshard's
(tests/fixtures/deepspeed/check_universal.py), is recorded in universal_by_zeroshard.json, checked here.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from zeroshard.checkpoint import (CheckpointError, DeepSpeedCheckpoint, get_layer_ckpt_name_for_rank,
                                  get_model_ckpt_name_for_rank, get_zero_ckpt_name_for_rank)
from zeroshard.checkpoint import constants
from zeroshard.checkpoint.deepspeed_format import DeepSpeedReader, deepspeed_directory
from zeroshard.checkpoint.deepspeed_format.convert import convert_deepspeed, convert_to_universal
from zeroshard.checkpoint.ds_to_universal import main, parse_arguments
from zeroshard.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"


def same_state(a: DeepSpeedReader, b: DeepSpeedReader) -> None:
    assert a.param_names() == b.param_names() and (a.stage, a.bf16) == (b.stage, b.bf16)
    for name in a.param_names():
        for key in ("param", "optim.exp_avg", "optim.exp_avg_sq"):
            assert torch.equal(a.read(name, key), b.read(name, key)), (name, key)
    assert a.whole.scalars == b.whole.scalars
    assert a.data["optimizer"] == b.data["optimizer"] and a.data["engine"] == b.data["engine"]
    extra, extra_b = a.extra(), b.extra()
    assert sorted(extra) == sorted(extra_b) and all(torch.equal(extra[k], extra_b[k]) for k in extra)


@pytest.mark.parametrize("case", ["zero1_bf16", "zero2_fp32", "zero3_fp32"])
def test_ds_to_universal_and_back(case: str, tmp_path: Path) -> None:
    out = tmp_path / "step3_universal"
    main(parse_arguments(["--input_folder", str(FIXTURES / case / "checkpoint" / "step3"), "--output_folder", str(out),
                          "--inject_missing_state"]))
    assert (tmp_path / "latest_universal").read_text() == out.name
    stage = int(case[4])
    assert sorted(p.name for p in (out / "zero" / "fc1.weight").iterdir()) == \
        ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt"] + (["step.pt"] if stage < 3 else [])
    assert (out / "zero" / "shift" / "fp32.pt").is_file() == (stage < 3)  # DeepSpeed's buffers at stages 1-2
    universal = deepspeed_directory(tmp_path, None)
    assert universal == out
    source = DeepSpeedReader(FIXTURES / case / "checkpoint" / "step3")
    same_state(source, DeepSpeedReader(out))
    whole = get_fp32_state_dict_from_zero_checkpoint(str(FIXTURES / case / "checkpoint"))
    again = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert list(whole) == list(again) and all(torch.equal(whole[k], again[k]) for k in whole)
    assert list(whole) == ["shift", "frozen.weight", "fc1.weight", "fc1.bias", "norm.weight", "norm.bias",
                           "fc2.weight", "fc2.bias"]
    assert torch.equal(whole["fc1.weight"], source.tensor("fc1.weight"))


def test_a_zeroshard_checkpoint_as_universal(tmp_path: Path) -> None:
    ours = tmp_path / "zeroshard"
    convert_deepspeed(FIXTURES / "zero3_bf16" / "checkpoint", ours)
    folder = convert_to_universal(ours, tmp_path / "universal", world_size=3, stage=3)
    assert (tmp_path / "universal" / "latest_universal").read_text() == folder.name == "step3"
    same_state(DeepSpeedReader(FIXTURES / "zero3_bf16" / "checkpoint" / "step3"), DeepSpeedReader(folder))


def test_deepspeed_checkpoint_describes_the_files() -> None:
    ckpt = DeepSpeedCheckpoint(str(FIXTURES / "zero2_bf16" / "checkpoint" / "step3"))
    assert (ckpt.original_tp_degree, ckpt.original_pp_degree, ckpt.original_dp_degree) == (1, 1, 2)
    assert ckpt.world_size == 2 and not ckpt.is_change_dp_degree() and ckpt.get_iteration() == 3
    assert [Path(f).name for f in ckpt.zero_files] == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                                       for r in range(2)]
    assert [Path(f).name for f in ckpt.mp_rank_files] == ["mp_rank_00_model_states.pt"] and not ckpt.layer_files
    state = ckpt.get_zero_checkpoint_state(pp_index=0, tp_index=0, dp_index=1, strip_tensor_paddings=False)
    assert state[constants.OPTIMIZER_STATE_DICT][constants.GROUP_PADDINGS] == [2]
    assert ckpt.global_state[constants.PARAM_SHAPES][0]["fc1.weight"] == torch.Size([13, 9])
    with pytest.raises(CheckpointError, match="tensor degree 2"):
        DeepSpeedCheckpoint(str(FIXTURES / "zero2_bf16" / "checkpoint" / "step3"), tp_degree=2)


def test_file_names_and_the_constants_zero_to_fp32_imports() -> None:
    assert get_model_ckpt_name_for_rank("d", "00") == str(Path("d") / "mp_rank_00_model_states.pt")
    assert get_zero_ckpt_name_for_rank("d", 3, 0) == str(Path("d") / "zero_pp_rank_3_mp_rank_00_optim_states.pt")
    assert get_layer_ckpt_name_for_rank("d", "layer_01", 1) == str(Path("d") / "layer_01-model_01_model_states.pt")
    # the names DeepSpeed 0.19.8's zero_to_fp32.py imports from deepspeed.checkpoint.constants
    for name in ("DS_VERSION", "OPTIMIZER_STATE_DICT", "SINGLE_PARTITION_OF_FP32_GROUPS", "FP32_FLAT_GROUPS",
                 "ZERO_STAGE", "PARTITION_COUNT", "PARAM_SHAPES", "BUFFER_NAMES", "FROZEN_PARAM_SHAPES",
                 "FROZEN_PARAM_FRAGMENTS", "AUTOEP_LAYERS_KEY", "AUTOEP_LAYERS_KEY_LEGACY",
                 "AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY", "AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT",
                 "PARAM_ALIGNMENT_PADDINGS"):
        assert isinstance(getattr(constants, name), str), name
    model = torch.load(FIXTURES / "zero3_fp32" / "checkpoint" / "step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                       weights_only=False)
    assert {constants.PARAM_SHAPES, constants.BUFFER_NAMES, constants.FROZEN_PARAM_SHAPES,
            constants.FROZEN_PARAM_FRAGMENTS, constants.DS_VERSION} <= set(model)
    assert ast.literal_eval(repr(constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE)) > 0


def test_real_deepspeed_wrote_the_same_universal_files() -> None:
    """The outcome of check_universal.py under real DeepSpeed (see its docstring)."""
    record = json.loads((FIXTURES / "universal_by_zeroshard.json").read_text())
    assert record["deepspeed"] == "0.19.8"
    tied = ["tied_zero2_fp32", "tied_zero3_fp32", "tied_frozen_zero3_fp32"]  # a weight under two names
    assert sorted(record["cases"]) == sorted([f"zero{s}_{p}" for s in (1, 2, 3) for p in ("fp32", "bf16")] + tied)
    for case, got in record["cases"].items():
        assert got["same_files"] and got["files"] > (15 if case in tied else 20) and not got["differing"], case


def test_deepspeeds_pickled_classes_resolve_under_its_face() -> None:
    """DeepSpeed's own ``zero_to_fp32.py`` unpickles its files with ``weights_only=False``: under
    ``install_as_deepspeed()`` every class they name must be found at its DeepSpeed path."""
    import importlib

    from zeroshard.checkpoint.deepspeed_format.unpickle import STAND_INS

    for name, cls in STAND_INS.items():
        module, _, attribute = name.rpartition(".")
        found = getattr(importlib.import_module("zeroshard" + module[len("deepspeed"):]), attribute)
        assert found is cls or (issubclass(found, int) and found(3).name == cls(3).name), name
