"""DeepSpeed's checkpoint files read as data (zeroshard/checkpoint/deepspeed_format/), without DeepSpeed.

The fixtures are real DeepSpeed 0.19.8 checkpoints (tests/fixtures/deepspeed/make_fixtures.py).  At
stages 0-2 DeepSpeed also saves the whole module, so the masters rebuilt from its partitions are checked
against it independently: bitwise in fp32, and rounding to the saved weights in bf16.  ZeRO-3 rebuilds
the same model as ZeRO-2 (both trained the same steps).  A file naming any global beyond the stand-ins
is refused by name before anything is unpickled.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from zeroshard.checkpoint.deepspeed_format import DeepSpeedPickleError, DeepSpeedReader, deepspeed_directory
from zeroshard.checkpoint.deepspeed_format.unpickle import load_deepspeed_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"


def reader(case: str) -> DeepSpeedReader:
    directory = deepspeed_directory(FIXTURES / case / "checkpoint", None)
    assert directory is not None
    return DeepSpeedReader(directory)


@pytest.mark.parametrize("case", ["zero0_fp32", "zero1_fp32", "zero2_fp32", "zero0_bf16", "zero1_bf16", "zero2_bf16"])
def test_masters_equal_the_saved_module(case: str) -> None:
    ds = reader(case)
    module = load_deepspeed_file(ds.directory / "mp_rank_00_model_states.pt")["module"]
    assert list(ds.param_names()) == [k for k in module if k not in ("frozen.weight", "shift")]
    for name in ds.param_names():
        saved = module[name]
        master = ds.tensor(name)
        assert torch.equal(master.to(saved.dtype), saved), name
        assert ds.tensor(name, "optim.exp_avg_sq").min() >= 0
    # without ZeRO, DeepSpeed's bf16 optimizer creates its state with one step of zero gradients
    assert ds.whole.scalars == [{"step": torch.tensor(4.0 if case == "zero0_bf16" else 3.0)}]
    assert ds.data["engine"]["global_steps"] == 3 and ds.data["lr_scheduler"] == {"last_batch_iteration": 2}
    assert {k: ds.client_state()[k] for k in ("epoch", "note", "best_loss")} == {"epoch": 4, "note": "tiny",
                                                                                 "best_loss": 0.125}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_buffers_and_frozen_parameters_at_every_stage(precision: str) -> None:
    """Stages 0-2 keep them in the model file, stage 3 the frozen weight in every rank's fragments."""
    zero, one, two, three = (reader(f"zero{stage}_{precision}").extra() for stage in (0, 1, 2, 3))
    assert sorted(zero) == sorted(one) == sorted(two) == sorted(three) == ["frozen.weight", "shift"]
    assert three["frozen.weight"].shape == (9, 9)
    for name in one:
        assert all(torch.equal(one[name], other[name]) for other in (zero, two, three)), name
    assert not torch.equal(one["shift"], torch.zeros(5))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage3_rebuilds_what_stage2_saved(precision: str) -> None:
    two, three = reader(f"zero2_{precision}"), reader(f"zero3_{precision}")
    assert three.stage == 3 and three.param_names() == two.param_names()
    for name in two.param_names():
        for key in ("param", "optim.exp_avg", "optim.exp_avg_sq"):
            assert torch.allclose(three.read(name, key), two.read(name, key), rtol=1e-5, atol=1e-7), (name, key)


class Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_a_foreign_global_is_refused_by_name(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "zero3_fp32" / "checkpoint", tmp_path / "checkpoint")
    target = tmp_path / "checkpoint" / "step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    state = {"optimizer_state_dict": {"zero_stage": 3, "payload": Exploit(str(tmp_path / "ran"))}, "ds_version": "0.19.8"}
    torch.save(state, target)
    with pytest.raises(DeepSpeedPickleError, match="does not read as data: posix.system [(]nothing") as err:
        reader_of = deepspeed_directory(tmp_path / "checkpoint", None)
        assert reader_of is not None
        DeepSpeedReader(reader_of)
    assert str(target) in str(err.value)
    assert not (tmp_path / "ran").exists()


def test_a_zeroshard_checkpoint_is_not_taken_for_deepspeed(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("t")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "manifest.json").write_text("{}")
    (tmp_path / "t" / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert deepspeed_directory(tmp_path, None) is None
    assert deepspeed_directory(tmp_path / "nothing", None) is None


def test_convert_writes_a_zeroshard_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zeroshard.checkpoint import CheckpointReader, consolidate, describe
    from zeroshard.checkpoint.load import check_manifest
    from zeroshard.tools.cli import main

    assert main(["convert", str(FIXTURES / "zero3_bf16" / "checkpoint"), str(tmp_path / "zs")]) == 0
    assert "wrote" in capsys.readouterr().out
    ds = reader("zero3_bf16")
    with CheckpointReader(tmp_path / "zs" / "step3") as converted:  # verifies every checksum
        check_manifest(converted.directory, converted.data)
        assert converted.param_names() == ds.param_names()
        for name in ds.param_names():
            for key in ("param", "optim.exp_avg", "optim.exp_avg_sq"):
                assert torch.equal(converted.read(name, key), ds.read(name, key)), (name, key)
        assert converted.scalar_state(0) == {"step": torch.tensor(3.0)}
        data = converted.data
        assert data["engine"]["global_steps"] == 3 and data["lr_scheduler"] == {"last_batch_iteration": 2}
        assert data["client_state"]["epoch"] == 4 and data["client_state"]["ds_version"] == "0.19.8"
    assert "checksums verified" in describe(tmp_path / "zs")
    consolidate(tmp_path / "zs", tmp_path / "model.safetensors")
    from safetensors.torch import load_file
    weights = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(weights[n], ds.tensor(n)) for n in ds.param_names())


def test_stage0_state_given_to_another_list_of_parameters_is_refused() -> None:
    from zeroshard.checkpoint.deepspeed_format.partitions import merge_stage0

    model = load_deepspeed_file(FIXTURES / "zero0_fp32" / "checkpoint" / "step3" / "mp_rank_00_model_states.pt")
    optimizer = model["optimizer"]
    shifted = {"state": {i - 1: v for i, v in optimizer["state"].items()}, "param_groups": optimizer["param_groups"]}
    with pytest.raises(Exception, match="has shape .* but the parameter in its place, frozen.weight"):
        merge_stage0(model["module"], model["buffer_names"], shifted, "here")


@pytest.mark.parametrize("what", ["layer_01-model_states.pt", "expp_rank_0_mp_rank_00_expert_0_model_states.pt",
                                  "layer_0_expert_0_mp_rank_00_model_states.pt"])
def test_layouts_not_read_are_refused_by_name(tmp_path: Path, what: str) -> None:
    """Pipeline layer files or MoE expert files beside a model file of neither."""
    shutil.copytree(FIXTURES / "zero1_fp32" / "checkpoint", tmp_path / "checkpoint")
    target = tmp_path / "checkpoint" / "step3" / what
    target.write_bytes(b"")
    directory = deepspeed_directory(tmp_path / "checkpoint", None)
    assert directory is not None
    with pytest.raises(Exception, match="records no (pipeline|MoE layers).*not read|expert files .* not read"):
        DeepSpeedReader(directory)


@pytest.mark.parametrize("case, odd", [("pipe2_zero1_fp32", "layer_01-model_01-model_states.pt"),
                                       ("pipe2_zero1_bf16", "layer_01-model_01-model_states.pt"),
                                       ("moe_ep2_zero1_fp32", "expert_1_mp_rank_00_model_states.pt")])
def test_pipeline_and_moe_checkpoints_read_whole(tmp_path: Path, case: str, odd: str) -> None:
    """DeepSpeed's pipeline (2 stages, fp32 and bf16) and MoE (2 experts at ep_size 2) fixtures read as one
    model under global names: each master equals (in bf16: rounds to) the weight DeepSpeed's layer or
    expert file holds, the moments are whole, each stage or expert-parallel position has its own group; a
    tensor-parallel layer file or an expert file of another naming is refused by name."""
    ds = DeepSpeedReader(deepspeed_directory(FIXTURES / case / "checkpoint", None))
    files = ds.layers or {**ds.model["module"], **ds.experts}
    assert sorted(ds.param_names()) == sorted(files) and ds.stage == 1 and ds.world_size == (1 if ds.layers else 2)
    assert ds.bf16 == case.endswith("bf16")
    for name in ds.param_names():
        assert ds.tensor(name).dtype == torch.float32
        assert torch.equal(ds.tensor(name).to(files[name].dtype), files[name]), name
        assert ds.read(name, "optim.exp_avg_sq").numel() == files[name].numel()
    groups = {ds.bucket_of(n) for n in ds.param_names()}
    assert groups == set(range(len(ds.whole.scalars))) and len(groups) == (2 if ds.layers else 3)
    assert ds.data["engine"]["global_steps"] == 3 and ds.data["lr_scheduler"] == {"last_batch_iteration": 2}
    shutil.copytree(FIXTURES / case / "checkpoint", tmp_path / "checkpoint")
    (tmp_path / "checkpoint" / "step3" / odd).write_bytes(b"")
    with pytest.raises(Exception, match="not read"):
        DeepSpeedReader(deepspeed_directory(tmp_path / "checkpoint", None))


def test_a_step_kept_per_group_is_read(tmp_path: Path) -> None:
    """DeepSpeed's FusedAdam of older checkpoints keeps Adam's step (an int) in the parameter group."""
    shutil.copytree(FIXTURES / "zero2_fp32" / "checkpoint", tmp_path / "checkpoint")
    for rank in range(2):
        path = tmp_path / "checkpoint" / "step3" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        saved = load_deepspeed_file(path)
        sd = saved["optimizer_state_dict"]
        sd["zero_stage"] = 2  # plain values only: the stand-ins do not pickle back under DeepSpeed's names
        del sd["loss_scaler"], sd["param_slice_mappings"]
        base = sd["base_optimizer_state"]
        base["param_groups"][0]["step"] = int(base["state"][0].pop("step"))
        torch.save(saved, path)
    directory = deepspeed_directory(tmp_path / "checkpoint", None)
    assert directory is not None
    ds = DeepSpeedReader(directory)
    assert ds.whole.scalars == [{"step": torch.tensor(3.0)}]
    assert "step" not in ds.data["optimizer"]["param_groups"][0]


@pytest.mark.parametrize("case", ["tied_zero2_fp32", "tied_zero3_fp32"])
def test_a_tied_weight_is_read_once_under_both_names(case: str, tmp_path: Path) -> None:
    """DeepSpeed's fixtures of a model whose output layer's weight is its embedding's: its partitions hold
    the weight once (``embed.weight``) and ``shared_params`` names ``head.weight``; the state dict has it
    under both names (stage 2: as the module DeepSpeed saved), and so does a consolidation of the
    converted checkpoint."""
    from safetensors.torch import load_file

    from zeroshard.checkpoint import consolidate
    from zeroshard.checkpoint.deepspeed_format.convert import convert_deepspeed

    ds = reader(case)
    assert ds.param_names() == ["embed.weight", "fc.weight", "fc.bias", "norm.weight", "norm.bias"]
    description = ds.model_description()
    assert description["trainable_of"]["head.weight"] == "embed.weight" and "head.weight" in description["state_dict_keys"]
    assert ds.extra() == {}
    state = ds.full_state_dict()
    assert list(state) == ["embed.weight", "fc.weight", "fc.bias", "norm.weight", "norm.bias", "head.weight"]
    assert torch.equal(state["head.weight"], state["embed.weight"])
    if ds.stage < 3:
        module = ds.model["module"]
        assert all(torch.equal(state[k], module[k]) for k in module)
    convert_deepspeed(FIXTURES / case / "checkpoint", tmp_path / "zs")
    consolidate(tmp_path / "zs", tmp_path / "model.safetensors")
    weights = load_file(tmp_path / "model.safetensors")
    assert sorted(weights) == sorted(state) and all(torch.equal(weights[k], state[k]) for k in state)


def test_a_tied_frozen_weight_is_read_under_both_names(tmp_path: Path) -> None:
    """The tied weight frozen (DeepSpeed's ZeRO-3 fixture): one frozen parameter in DeepSpeed's fragments,
    given under both names as ``zero_to_fp32.py`` gives it; rewritten in DeepSpeed's layout, the files
    hold DeepSpeed's own entries (the second name in ``shared_params`` only)."""
    from zeroshard.checkpoint.deepspeed_format.convert import convert_to_deepspeed

    ds = reader("tied_frozen_zero3_fp32")
    assert ds.param_names() == ["fc.weight", "fc.bias", "norm.weight", "norm.bias"]
    extra = ds.extra()
    assert sorted(extra) == ["embed.weight", "head.weight"] and torch.equal(extra["head.weight"], extra["embed.weight"])
    state = ds.full_state_dict()
    assert list(state) == ["embed.weight", "fc.weight", "fc.bias", "norm.weight", "norm.bias", "head.weight"]
    target = convert_to_deepspeed(FIXTURES / "tied_frozen_zero3_fp32" / "checkpoint", tmp_path, 2, 3)
    for rank in range(2):
        name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        mine, own = load_deepspeed_file(target / name), load_deepspeed_file(ds.directory / name)
        for entry in ("shared_params", "param_shapes", "frozen_param_shapes"):
            assert mine[entry] == own[entry], (name, entry)
        assert list(mine["module"]) == list(own["module"]) and list(mine["frozen_param_fragments"]) == ["embed.weight"]
