"""DeepSpeed's helpers over zeroshard's parts, in one process: TiledLinear, OnDevice, partition_balanced,
the expert groups' ranks, the pinned-memory total, get_optim_files, make_executable, and a load from a
directory with no latest checkpoint."""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.checkpoint.utils import get_model_ckpt_name_for_rank, make_executable
from zeroshard.deepspeed.utils.groups import _get_expert_parallel_ranks
from zeroshard.experts.groups import ExpertParallelError
from zeroshard.host.pinned_total import PinnedMemoryTotal, format_bytes
from zeroshard.pipeline import TooFewLayersError
from zeroshard.pipeline.partition import partition
from zeroshard.runtime.utils import partition_balanced
from zeroshard.sharding.stage3.tiled_linear import TileCountError, TiledLinear, TiledLinearReturnBias
from zeroshard.utils.zero_to_fp32 import get_optim_files


class _ReturnsBias(nn.Linear):
    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        return nn.functional.linear(input, self.weight), self.bias


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_f,out_f,in_splits,out_splits", [(32, 40, 1, 1), (23, 29, 2, 3), (29, 23, 5, 4)])
def test_tiled_linear_computes_the_full_layer(bias: bool, in_f: int, out_f: int, in_splits: int,
                                              out_splits: int) -> None:
    torch.manual_seed(0)
    full = nn.Linear(in_f, out_f, bias=bias)
    tiled = TiledLinear(in_f, out_f, bias=bias, in_splits=in_splits, out_splits=out_splits,
                        init_linear=copy.deepcopy(full))
    x = torch.randn(3, in_f)
    torch.testing.assert_close(tiled(x), full(x))
    full(x).square().sum().backward()
    tiled(x).square().sum().backward()
    assert full.weight.grad is not None
    for o in range(out_splits):
        rows = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
        for i in range(in_splits):
            tile = tiled.tile(o, i)
            torch.testing.assert_close(tile.weight.grad, full.weight.grad[rows, tiled.in_parts[i]:tiled.in_parts[i + 1]])
            assert (tile.bias is not None) == (bias and i == in_splits - 1)
            if tile.bias is not None:
                torch.testing.assert_close(tile.bias.grad, full.bias.grad[rows])


def test_tiled_linear_parts_options_and_refusals() -> None:
    assert TiledLinear(10, 7, in_splits=3, out_splits=2).in_parts == [0, 4, 7, 10]
    for splits in (0, 33):
        with pytest.raises(TileCountError):
            TiledLinear(32, 32, in_splits=splits)
    torch.manual_seed(1)
    full = nn.Linear(6, 4)
    split = TiledLinear(6, 4, in_splits=2, out_splits=2, input_is_already_split=True, combine_out_splits=False,
                        init_linear=full)
    x = torch.randn(2, 6)
    parts = split([x[:, :3], x[:, 3:]])
    torch.testing.assert_close(torch.cat(parts, dim=-1), full(x))
    with pytest.raises(ValueError, match="bias"):
        TiledLinear(6, 4, bias=False).copy_params_from(full)
    returning = _ReturnsBias(6, 4)
    tiled = TiledLinearReturnBias(6, 4, in_splits=2, out_splits=2, linear_cls=_ReturnsBias, init_linear=returning)
    out, bias = tiled(x)
    expected_out, expected_bias = returning(x)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(bias, expected_bias)
    assert isinstance(zeroshard.zero.TiledLinear(4, 4), TiledLinear)


def test_on_device_builds_on_the_device_in_the_dtype() -> None:
    default = torch.get_default_dtype()
    with zeroshard.OnDevice(dtype=torch.float16, device="meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Embedding(3, 4))
        explicit = torch.zeros(2, dtype=torch.float32)
        counts = torch.arange(3)
    assert all(p.device.type == "meta" and p.dtype == torch.float16 for p in model.parameters())
    assert explicit.dtype == torch.float16 and counts.dtype == torch.int64 and counts.device.type == "meta"
    assert torch.get_default_dtype() == default and torch.zeros(1).device.type == "cpu"
    with zeroshard.OnDevice(dtype=torch.float16, device="meta", enabled=False):
        assert nn.Linear(2, 2).weight.dtype == default
    with pytest.raises(ValueError):
        zeroshard.OnDevice(dtype=torch.int8)


def test_partition_balanced_answers_more_parts_than_weights_and_the_pipeline_refuses() -> None:
    assert partition_balanced([1, 2, 1], 4) == [0, 1, 2, 3, 3]
    bounds = partition_balanced([1, 1, 1, 1, 0, 1], 4)
    sums = [sum([1, 1, 1, 1, 0, 1][a:b]) for a, b in zip(bounds, bounds[1:])]
    assert max(sums) == 2 and len(bounds) == 5
    with pytest.raises(TooFewLayersError):
        partition([nn.Linear(2, 2)] * 3, 4, "uniform")
    with pytest.raises(ValueError):
        partition_balanced([1, 2], 0)


def test_expert_parallel_ranks_follow_the_experts_layout() -> None:
    exchange, same_experts = _get_expert_parallel_ranks(world_size=16, tensor_parallel_size_=2,
                                                        expert_parallel_size_=4)
    assert exchange == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert same_experts[:4] == [[0, 8], [2, 10], [4, 12], [6, 14]]
    exchange, same_experts = _get_expert_parallel_ranks(8, 1, 2, pipeline_parallel_size_=2)
    assert exchange == [[0, 1], [2, 3], [4, 5], [6, 7]] and same_experts == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(ExpertParallelError):
        _get_expert_parallel_ranks(16, 2, 3)
    with pytest.raises(ExpertParallelError):
        _get_expert_parallel_ranks(16, 2, 4, use_data_before_expert_parallel_=True)


def test_pinned_total_logs_each_milestone_once() -> None:
    total = PinnedMemoryTotal()
    gib = 1024 ** 3
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    zeroshard_logger = logging.getLogger("zeroshard")
    zeroshard_logger.addHandler(handler)
    try:
        total.track(30 * gib)
        total.track(110 * gib)  # 140 GiB: past 32, 64 and 128
    finally:
        zeroshard_logger.removeHandler(handler)
    assert [m.split(":")[0] for m in messages if "checkpoint" in m] == [
        "[pinned-memory checkpoint] crossed 32.000 GB", "[pinned-memory checkpoint] crossed 64.000 GB",
        "[pinned-memory checkpoint] crossed 128.000 GB"]
    assert total.pinned_bytes == 140 * gib and total.pin_calls == 2
    assert [format_bytes(n) for n in (512, 2048, 2 ** 20)] == ["512 B", "2.0 KB", "1.00 MB"]
    with pytest.raises(ValueError):
        total.track(-1)


def test_optim_files_in_rank_order_and_checkpoint_file_names(tmp_path) -> None:
    for rank in (10, 2, 1, 0):
        (tmp_path / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_text("")
    assert [os.path.basename(f).split("_")[3] for f in get_optim_files(tmp_path)] == ["0", "1", "2", "10"]
    with pytest.raises(FileNotFoundError):
        get_optim_files(tmp_path / "absent")
    assert get_model_ckpt_name_for_rank("ckpt", "00") == os.path.join("ckpt", "mp_rank_00_model_states.pt")
    script = tmp_path / "script.py"
    script.write_text("")
    assert make_executable(script) and os.access(script, os.X_OK)
    assert not make_executable(tmp_path / "missing.py")


def test_loading_a_directory_without_latest_loads_nothing(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    model = nn.Linear(4, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine, _, _, _ = zeroshard.initialize(model=model, config={"train_batch_size": 1, "optimizer": {
        "type": "AdamW", "params": {"lr": 0.1}}})
    assert engine.load_checkpoint(tmp_path) == (None, None)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])
    with pytest.raises(zeroshard.checkpoint.CheckpointError):
        engine.load_checkpoint(tmp_path, tag="absent")  # a named tag must exist
