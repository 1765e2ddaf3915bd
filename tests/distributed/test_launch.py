"""The main job under torchrun, end to end: `zeroshard demo` launches 2 ranks that train and report."""

import json
import subprocess
import sys

import pytest

from zeroshard.cli import build_parser


def run_demo(*args: str, out: str = "") -> str:
    extra = ["--out", out] if out else []
    proc = subprocess.run([sys.executable, "-m", "zeroshard.cli", "demo", *args, *extra], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_demo_trains_under_torchrun_and_reports_memory(tmp_path) -> None:
    out = run_demo("--steps", "4", "--nproc", "2", out=str(tmp_path))
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "checkpoint" / "latest").is_file()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") >= 1
    assert "4/4 [" in out and "tokens/s]" in out  # tqdm's bar, the metrics as its postfix
    assert "ZeRO stage 3, world size 2" in out
    assert "held-out loss" in out
    assert "rank 0 memory:" in out and "rank 1 memory:" in out
    assert "---- sample ----" in out


def test_demo_takes_a_config_file(tmp_path) -> None:
    config = {"train_batch_size": 8, "steps_per_print": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 1}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    out = run_demo("--steps", "2", "--nproc", "2", "--config", str(path), out=str(tmp_path / "run"))
    assert "ZeRO stage 1, world size 2, global batch 8" in out
    assert "step 2: loss" in out


def test_cli_flags() -> None:
    args = build_parser().parse_args(["demo", "--stage", "1", "--nproc", "3", "--steps", "7", "--config", "x.json",
                                      "--out", "o"])
    assert (args.stage, args.nproc, args.steps, args.config, args.out) == (1, 3, 7, "x.json", "o")
    args = build_parser().parse_args(["consolidate", "c", "o.safetensors", "--dtype", "bf16", "--tag", "t"])
    assert (args.checkpoint, args.out, args.dtype, args.tag) == ("c", "o.safetensors", "bf16", "t")
    assert build_parser().parse_args(["ckpt-info", "c", "--tag", "t"]).tag == "t"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--stage", "4"])
