"""DeepSpeed's Megatron-style reshape maps under zeroshard (``deepspeed.checkpoint``'s ``model_3d_desc``,
``get_model_3d_descriptor``, ``ZeROCheckpoint``), the layout entry of a model file and the checks of the
model files' metadata, on real DeepSpeed 0.19.8 checkpoints (tests/fixtures/deepspeed/) and small folders
written here."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch

from zeroshard.checkpoint import (CheckpointError, DeepSpeedCheckpoint, ZeROCheckpoint, get_model_3d_descriptor,
                                  model_3d_desc, reshape_meg_2d_parallel)
from zeroshard.checkpoint import constants as C
from zeroshard.checkpoint.deepspeed_format import DeepSpeedReader
from zeroshard.checkpoint.deepspeed_format.layout_metadata import (aggregate_autoep_zero12_metadata,
                                                                   checkpoint_parallel_metadata)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"


def cells(maps: list[Any]) -> list[dict[str, list[int]]]:
    return [dict(m.map) for m in maps]


def test_each_axis_contracts_into_contiguous_runs() -> None:
    src = model_3d_desc(pp_degree=2, tp_degree=2, dp_degree=2)
    # ZeRO file d * 4 + i is data rank d's copy of model file i (stage i // 2, tensor rank i % 2)
    assert cells(src.reshape(model_3d_desc(1, 1, 1))) == [{"0,0": [0, 4, 1, 5, 2, 6, 3, 7]}]
    assert cells(src.reshape(model_3d_desc(1, 2, 1))) == [{"0,0": [0, 4, 2, 6], "0,1": [1, 5, 3, 7]}]
    # a cell's list runs over its model files, each file's data ranks in turn, before it is cut by data rank
    assert cells(src.reshape(model_3d_desc(2, 1, 2))) == [{"0,0": [0, 4], "1,0": [2, 6]},
                                                          {"0,0": [1, 5], "1,0": [3, 7]}]
    assert cells(src.reshape(model_3d_desc(2, 2, 2))) == [{"0,0": [0], "0,1": [1], "1,0": [2], "1,1": [3]},
                                                          {"0,0": [4], "0,1": [5], "1,0": [6], "1,1": [7]}]
    assert reshape_meg_2d_parallel(2, 4, 1, 2).get_data(0, 1) == [2, 3, 6, 7]
    assert src.world_size() == 8 and src.is_valid(1, 1, 2) == (False, ["DP indexing error: index 2 >= degree 2"])


def test_a_layout_that_would_split_a_file_is_refused() -> None:
    src = model_3d_desc(pp_degree=2, tp_degree=4, dp_degree=2)
    assert src.can_reshape(model_3d_desc(1, 3, 1)) == (False, ["TP: degree 3 does not divide the saved degree 4"])
    ok, errors = src.can_reshape(model_3d_desc(4, 4, 2))
    assert not ok and errors == ["Expansion reshape not supported - PP: 2 ---> 4"]
    with pytest.raises(ValueError, match="Expansion"):
        src.reshape(model_3d_desc(4, 4, 2))


def write_layout(folder: Path, dims: list[Optional[dict[str, int]]], data_ranks: int = 2,
                 layers: Any = None) -> None:
    for mp, dim in enumerate(dims):
        state: dict[str, Any] = {C.PARAM_SHAPES: [{"w": torch.Size([2])}], "ds_config": {}, "iteration": 7}
        if dim is not None:
            state[C.CHECKPOINT_PARALLEL_DIMS] = dim
        if layers is not None:
            state[C.AUTOEP_LAYERS_KEY] = layers
        torch.save(state, folder / f"mp_rank_{mp:02d}_model_states.pt")
        for dp in range(data_ranks):
            torch.save({}, folder / f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt")


def degrees(desc: model_3d_desc) -> tuple[int, int, int]:
    return desc.pp_degree, desc.tp_degree, desc.dp_degree


def test_the_layout_is_read_from_the_model_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert degrees(get_model_3d_descriptor(str(FIXTURES / "zero2_bf16" / "checkpoint" / "step3"))) == (1, 1, 2)
    assert degrees(get_model_3d_descriptor(str(FIXTURES / "pipe2_zero1_fp32" / "checkpoint" / "step3")))[0] == 2
    legacy, pipe, bad = tmp_path / "legacy", tmp_path / "pipe", tmp_path / "bad"
    for folder in (legacy, pipe, bad):
        folder.mkdir()
    write_layout(legacy, [None, None], data_ranks=3)  # written before the entry: every file a tensor rank
    assert degrees(get_model_3d_descriptor(str(legacy))) == (1, 2, 3)
    write_layout(pipe, [checkpoint_parallel_metadata(SimpleNamespace(
        get_pipe_parallel_world_size=lambda: 2, get_slice_parallel_world_size=lambda: 1))[C.CHECKPOINT_PARALLEL_DIMS]] * 2)
    loads: list[str] = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda path, *a, **k: (loads.append(str(path)), load(path, *a, **k))[1])
    ckpt = DeepSpeedCheckpoint(str(pipe))
    assert loads == ckpt.mp_rank_files and ckpt.get_iteration() == 7  # each model file read once
    assert (ckpt.pp_degree, ckpt.tp_degree, ckpt.dp_degree) == (2, 1, 2)
    assert ckpt.get_zero_files(1, 0, 1) == [str(pipe / "zero_pp_rank_1_mp_rank_01_optim_states.pt")]
    write_layout(bad, [{"pp_degree": 1, "tp_degree": 2}, {"pp_degree": 1, "tp_degree": 1}])
    with pytest.raises(CheckpointError, match="disagrees across model-state files"):
        ZeROCheckpoint(str(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="without model files"):
        get_model_3d_descriptor(str(empty))


def test_the_model_files_metadata_is_checked(tmp_path: Path) -> None:
    assert checkpoint_parallel_metadata(None) == {C.CHECKPOINT_PARALLEL_DIMS: {"pp_degree": 1, "tp_degree": 1}}
    megatron = SimpleNamespace(get_pipeline_model_parallel_world_size=lambda: 3,
                               get_tensor_model_parallel_world_size=lambda: 2)
    assert checkpoint_parallel_metadata(megatron)[C.CHECKPOINT_PARALLEL_DIMS] == {"pp_degree": 3, "tp_degree": 2}
    layer = {"expert_key_prefix": "layers.0.experts", "num_experts": 4, "num_local_experts": 2, "ep_size": 2}
    write_layout(tmp_path, [{"pp_degree": 1, "tp_degree": 2}] * 2, layers=[layer])
    shapes, layers, data_first = aggregate_autoep_zero12_metadata(DeepSpeedCheckpoint(str(tmp_path)).model_state_metadata)
    assert shapes == [{"w": torch.Size([2])}] * 2 and layers == [layer] and data_first is False
    other = [(f, {**m, C.AUTOEP_LAYERS_KEY: [{**layer, "num_experts": 8}]})
             for f, m in DeepSpeedCheckpoint(str(tmp_path)).model_state_metadata]
    with pytest.raises(CheckpointError, match="Conflicting AutoEP metadata"):
        aggregate_autoep_zero12_metadata([*DeepSpeedCheckpoint(str(tmp_path)).model_state_metadata, other[1]])
    with pytest.raises(CheckpointError, match="must be a list"):
        aggregate_autoep_zero12_metadata([(f, {**m, C.AUTOEP_LAYERS_KEY: "str"}) for f, m in other])


@pytest.mark.parametrize("case", ["zero1_bf16", "zero2_fp32"])
def test_one_data_rank_reads_the_whole_group(case: str) -> None:
    folder = FIXTURES / case / "checkpoint" / "step3"
    whole = DeepSpeedCheckpoint(str(folder), dp_degree=1)
    assert whole.is_change_dp_degree() and len(whole.get_zero_files(0, 0, 0)) == 2
    state = whole.get_zero_checkpoint_state(0, 0, 0)[C.OPTIMIZER_STATE_DICT]
    assert state[C.GROUP_PADDINGS] == [0] and state[C.PARTITION_COUNT] == [1]
    reader = DeepSpeedReader(folder)
    names = reader.param_names()
    for key, merged in (("param", state[C.SINGLE_PARTITION_OF_FP32_GROUPS][0]),
                        ("optim.exp_avg", state[C.BASE_OPTIMIZER_STATE]["state"][0]["exp_avg"]),
                        ("optim.exp_avg_sq", state[C.BASE_OPTIMIZER_STATE]["state"][0]["exp_avg_sq"])):
        assert torch.equal(merged, torch.cat([reader.read(n, key).flatten() for n in names])), key
    assert int(state[C.BASE_OPTIMIZER_STATE]["state"][0]["step"]) == 3
