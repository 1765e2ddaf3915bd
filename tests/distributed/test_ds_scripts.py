"""DeepSpeed-style scripts (argparse + add_config_arguments, init_distributed, the accelerator, zero.Init +
GatheredParameters(modifier_rank=0) in __init__, checkpoints with int tags, 16-bit export) run under
torchrun at world 2 and train exactly as zeroshard's own API does on the same model and data.

Each launch is shared by the tests that compare with it: the script's run at each stage (6 steps, which
a run of 3 steps and one resumed from it must also give), and its ``--native`` path, the reference, run
for every stage in one world of 2 (the script's own ``main()``, called in turn).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from zeroshard.tools.testing import case, free_port, run_world
from zeroshard.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

SCRIPT = Path(__file__).parent / "ds_scripts" / "train_ds_style.py"
STEPS = 6  # optimizer steps of the shared runs, each of 2 micro steps
STAGES = (1, 2, 3)
LAUNCHED_STAGES = (1, 3)  # by torchrun; stage 2 runs under `zeroshard run --as-deepspeed` below


def ds_config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 1e-2}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 10,
                                  "stage3_gather_16bit_weights_on_model_save": True}, **extra}


def write_config(tmp: Path, config: dict) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "ds.json"
    cfg.write_text(json.dumps(config))
    return cfg


def launch(tmp: Path, config: dict, *args: str, nproc: int = 2) -> dict:
    cfg = write_config(tmp, config)
    out = tmp / f"out{free_port()}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(SCRIPT), "--deepspeed", "--deepspeed_config", str(cfg), "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


class CompatRuns:
    """The DS-style script's run at each stage, launched the first time a test asks for it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[int, dict] = {}

    def __getitem__(self, stage: int) -> dict:
        if stage not in self.runs:
            self.runs[stage] = launch(self.root / f"compat_stage{stage}", ds_config(stage), "--steps", str(STEPS))
        return self.runs[stage]


@pytest.fixture(scope="module")
def compat_runs(tmp_path_factory) -> CompatRuns:
    return CompatRuns(tmp_path_factory.mktemp("compat"))


def native_worker(rank: int, world: int, runs: list[tuple[int, str, str]]) -> None:
    """The script's ``--native`` path for each (stage, config, output) in turn, in this one world."""
    spec = importlib.util.spec_from_file_location("train_ds_style", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = sys.argv
    try:
        for stage, config, out in runs:
            with case(stage=stage, world=world, path="native"):
                torch.manual_seed(0)
                sys.argv = [str(SCRIPT), "--deepspeed", "--deepspeed_config", config, "--out", out,
                            "--steps", str(STEPS), "--native"]
                script.main()
    finally:
        sys.argv = argv


@pytest.fixture(scope="module")
def native_runs(tmp_path_factory) -> dict[int, dict[str, Any]]:
    """zeroshard's own API on the script's model and data, at every stage: the losses and final lr."""
    root = tmp_path_factory.mktemp("native")
    runs = [(stage, str(write_config(root / f"stage{stage}", ds_config(stage))), str(root / f"stage{stage}" / "out.json"))
            for stage in STAGES]
    run_world(native_worker, 2, args=(runs,), timeout=600)
    return {stage: json.loads(Path(out).read_text()) for stage, _, out in runs}


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("stage", LAUNCHED_STAGES)
def test_ds_style_script_equals_native_api(compat_runs, native_runs, stage) -> None:
    compat, native = compat_runs[stage], native_runs[stage]
    assert len(compat["losses"]) == 2 * STEPS
    torch.testing.assert_close(torch.tensor(compat["losses"]), torch.tensor(native["losses"]), rtol=1e-6, atol=0)
    assert compat["lr"] == native["lr"]


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_an_unmodified_import_deepspeed_script_under_zeroshard_run_as_deepspeed(tmp_path, native_runs) -> None:
    """`zeroshard run --as-deepspeed --num_gpus 2` runs a script that says `import deepspeed`, passing
    --local_rank as the deepspeed launcher does; it trains exactly as zeroshard's own API."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ds_config(2)))
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "run", "--as-deepspeed", "--num_gpus", "2",
                           "--master_port", str(free_port()), str(SCRIPT), "--import-deepspeed", "--deepspeed",
                           "--deepspeed_config", str(cfg), "--out", str(out), "--steps", "3"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    # 3 steps of 2 micro steps: the reference's first 6 losses (no step's loss depends on the steps after it)
    assert json.loads(out.read_text())["losses"] == native_runs[2]["losses"][:6]


PIPE_SCRIPT = Path(__file__).parent / "ds_scripts" / "train_pipe_ds_style.py"


@pytest.mark.slow  # extended (a launcher run): runs in CI (see conftest.py)
def test_a_deepspeed_pipeline_script_trains_under_zeroshard_run_as_deepspeed(tmp_path) -> None:
    """DeepSpeed's pipeline example's shape (PipelineModule of LayerSpecs, initialize(training_data=...),
    train_batch() without an iterator), unmodified, at world 4: 2 stages x 2 data-parallel ranks."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
                               "optimizer": {"type": "Adam", "params": {"lr": 5e-3}}}))
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "run", "--as-deepspeed", "--num_gpus", "4",
                           "--master_port", str(free_port()), str(PIPE_SCRIPT), "--deepspeed", "--deepspeed_config",
                           str(cfg), "--out", str(out), "--steps", "12"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    losses = json.loads(out.read_text())["losses"]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3, losses


def test_run_refuses_several_nodes_by_deepspeed_flags() -> None:
    proc = subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "run", "--num_nodes", "2", "x.py"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--rdzv-endpoint" in proc.stderr


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_ds_style_script_resumes_from_an_int_tag_and_exports(tmp_path, compat_runs) -> None:
    config = ds_config(3)
    straight = compat_runs[3]  # 6 steps
    first = launch(tmp_path, config, "--steps", "3", "--save_dir", str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "3" / "manifest.json").is_file()
    second = launch(tmp_path, config, "--start_step", "3", "--steps", str(STEPS), "--load_dir", str(tmp_path / "ckpt"),
                    "--export_dir", str(tmp_path / "export"))
    assert first["losses"] + second["losses"] == straight["losses"]
    exported = torch.load(tmp_path / "export" / "pytorch_model.bin")  # a torch pickle, as its name says
    consolidated = torch.load(tmp_path / "export" / "consolidated.pt")
    assert set(exported) == set(consolidated) == {"body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias",
                                                  "head.weight", "head.bias"}
    assert all(v.dtype == torch.bfloat16 for v in exported.values())  # fp32 training: bf16 by default
    fp32 = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert fp32["head.weight"].dtype == torch.float32 and fp32["head.weight"].shape == (7, 40)
