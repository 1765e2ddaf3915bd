"""The main job under torchrun, end to end: `zeroshard demo` launches 2 ranks that train and report; the
command's flags have their effect."""

import contextlib
import io
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from zs_common import make_model, rank_micro_batches, zero_config

import zeroshard
from safetensors import safe_open

from zeroshard.tools.cli import build_parser, main
from zeroshard.tools.testing import run_world


def run_demo(*args: str, out: str = "") -> str:
    extra = ["--out", out] if out else []
    proc = subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "demo", *args, *extra], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_demo_trains_under_torchrun_and_reports_memory(tmp_path) -> None:
    # --config: the run follows a DeepSpeed config file (its batch, stage and optimizer)
    config = {"train_batch_size": 8, "steps_per_print": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 1}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    out = run_demo("--steps", "4", "--nproc", "2", "--config", str(tmp_path / "ds.json"), out=str(tmp_path))
    assert "ZeRO stage 1, world size 2, global batch 8" in out
    assert "step 4: loss" in out
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "checkpoint" / "latest").is_file()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") >= 1
    assert "4/4 [" in out and "tokens/s]" in out  # tqdm's bar, the metrics as its postfix
    # --lora fine-tunes those weights: loaded into the shards, base frozen and split across the ranks
    out = run_demo("--steps", "2", "--nproc", "2", "--lora", out=str(tmp_path))
    assert f"LoRA: base weights from {tmp_path / 'model.safetensors'}" in out
    assert (tmp_path / "lora" / "model.safetensors").is_file()
    with safe_open(str(tmp_path / "lora" / "model.safetensors"), "pt") as f:
        assert any(".lora_a" in k for k in f.keys()) and any(".base." in k for k in f.keys())
    frozen = [float(line.split("frozen_params ")[1].split(" MiB")[0]) for line in out.splitlines()
              if line.startswith("rank ") and "frozen_params" in line]
    total = float(out.split("the frozen base is ")[1].split(" MiB")[0])
    # (norms and biases, below the persistence threshold, stay whole on both ranks)
    assert len(frozen) == 2 and total <= sum(frozen) < 1.05 * total and max(frozen) < 0.6 * total
    assert "ZeRO stage 3, world size 2" in out
    assert "held-out loss" in out
    assert "rank 0 memory:" in out and "rank 1 memory:" in out
    assert "---- sample ----" in out


def two_tags_worker(rank: int, world: int, directory: str) -> list[dict]:
    """Saves tag "one" after one step and tag "two" (which becomes latest) after a second step."""
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=zero_config(2, 1, 1))
    states = []
    for step, tag in enumerate(("one", "two")):
        for x, y in rank_micro_batches(step, rank, world, 1, 1):
            engine.backward(engine(x, y))
            engine.step()
        engine.save_checkpoint(directory, tag=tag)
        states.append(engine.full_state_dict())
    return states


def cli(*args: str) -> str:
    """The command's own entry point in this process (what `zeroshard <args>` runs, without a new
    interpreter importing torch); its standard output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    assert code == 0, out.getvalue()
    return out.getvalue()


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_cli_flags(tmp_path) -> None:
    """Each flag has the effect it promises, seen in what the command does (not in argparse's namespace)."""
    # demo: --stage, --nproc, --precision, --steps and --out, none of them at its default
    out = run_demo("--stage", "1", "--nproc", "3", "--steps", "2", "--precision", "bf16", out=str(tmp_path / "demo"))
    assert "ZeRO stage 1, world size 3, global batch 48" in out
    manifest = json.loads((tmp_path / "demo" / "checkpoint" / "global_step2" / "manifest.json").read_text())
    assert (manifest["stage"], manifest["world_size"], manifest["compute_dtype"]) == (1, 3, "bfloat16")
    assert manifest["engine"]["global_steps"] == 2
    records = (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in records] == [1, 2]

    # consolidate and ckpt-info: --tag reads a tag other than latest, --dtype sets the written dtype
    ckpt = tmp_path / "ckpt"
    one, two = run_world(two_tags_worker, 2, args=(str(ckpt),))[0]
    assert (ckpt / "latest").read_text() == "two"
    cli("consolidate", str(ckpt), str(tmp_path / "one.safetensors"), "--tag", "one", "--dtype", "bf16")
    cli("consolidate", str(ckpt), str(tmp_path / "latest.safetensors"))
    tagged, latest = load_file(str(tmp_path / "one.safetensors")), load_file(str(tmp_path / "latest.safetensors"))
    assert list(tagged) == list(one) == list(latest)
    for name, value in one.items():
        assert tagged[name].dtype == torch.bfloat16 and torch.equal(tagged[name], value.to(torch.bfloat16)), name
        assert latest[name].dtype == torch.float32 and torch.equal(latest[name], two[name]), name
    # the two tags hold different weights, so reading the wrong one could not pass the checks above
    assert not torch.equal(one["blocks.1.qkv.weight"].to(torch.bfloat16), two["blocks.1.qkv.weight"].to(torch.bfloat16))
    assert "global step 1," in cli("ckpt-info", str(ckpt), "--tag", "one")
    assert "global step 2," in cli("ckpt-info", str(ckpt))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--stage", "4"])
