"""PyTorch Lightning's Trainer on zeroshard, launched by Lightning itself as its users launch it (the
script starts its second rank), every run of the family in that one world:

- Lightning's own ``DeepSpeedStrategy`` at ZeRO-1, 2 and 3, unmodified but for its CUDA-only checks, with
  ``import deepspeed`` answered by zeroshard (``install_as_deepspeed()``);
- zeroshard's strategy at stages 1-3 (``"zeroshard_stage_1"``, ``"zeroshard_stage_2"``,
  ``ZeroshardStrategy(stage=3, ...)``) with ``accumulate_grad_batches`` and ``gradient_clip_val``, and
  at stage 3 a module whose ``configure_model`` builds its layers (under ``zeroshard.Init``);
- a ``ModelCheckpoint`` save and a ``ckpt_path`` resume.

Each equals Lightning's DDP strategy with the same Trainer settings (fp32, to float rounding), and the
resumed run equals the uninterrupted one.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow  # extended (a launcher run): runs in CI (see conftest.py)

SCRIPT = Path(__file__).parent / "lightning_scripts" / "lightning_script.py"
TOLERANCE = 1e-5  # fp32, relative to each tensor's largest value


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("lightning")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=400, env=env, cwd=out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lightnings_deepspeed_strategy_trains_on_zeroshard_equal_to_ddp(lightning_runs, stage) -> None:
    assert lightning_runs[f"deepspeed_stage_{stage}_steps"] == lightning_runs["ddp_steps"] == 16
    assert lightning_runs[f"deepspeed_stage_{stage}"] <= TOLERANCE


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zeroshard_strategy_with_accumulation_and_clipping_equals_ddp(lightning_runs, stage) -> None:
    assert lightning_runs[f"zeroshard_stage_{stage}_steps"] == lightning_runs["ddp_accumulated_steps"] == 8
    assert lightning_runs[f"zeroshard_stage_{stage}"] <= TOLERANCE


def test_bf16_mixed_validate_and_test_run_on_the_engine(lightning_runs) -> None:
    found = lightning_runs["bf16_with_evaluation"]
    assert found["dtype"] == "torch.bfloat16"
    assert all(0 < found[k] < 2 for k in ("val_loss", "test_loss", "fresh_test_loss")), found
    assert found["val_loss"] == found["test_loss"]  # the same data, the same fitted weights


def test_a_model_built_in_configure_model_is_built_under_init_and_trains_equal_to_ddp(lightning_runs) -> None:
    assert lightning_runs["configure_model_under_init"] == [True]
    assert lightning_runs["zeroshard_stage_3_configure_model"] <= TOLERANCE


def test_a_model_checkpoint_resume_continues_equal_to_the_uninterrupted_run(lightning_runs) -> None:
    assert lightning_runs["checkpoints"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    assert lightning_runs["resumed_steps"] == lightning_runs["zeroshard_stage_3_steps"]
    assert lightning_runs["resumed"] == 0.0  # bitwise: weights, Adam moments and the loops' positions restored
