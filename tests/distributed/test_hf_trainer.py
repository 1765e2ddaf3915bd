"""Hugging Face Trainer and Accelerate, unmodified, with DeepSpeed configs, train on zeroshard.

The reference is the same script without DeepSpeed (Trainer's / Accelerate's own DDP on gloo): with
fp32, losses and the saved weights agree to float rounding.  Each script is launched by torchrun, each
launch once: the tests that compare with the same run (the DDP references, the stage-3 run a resumed
one must continue) share it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroshard.tools.testing import free_port

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPTS = Path(__file__).parent / "hf_scripts"


def launch(script: str, out: Path, *args: str, nproc: int = 2) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(SCRIPTS / script), "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    return json.loads((out / "result.json").read_text())


def final_weights(directory: Path) -> dict[str, torch.Tensor]:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(directory).state_dict()


class SharedLaunches:
    """Each run of the Trainer script, launched the first time a test asks for it: its result and its
    output directory (``dir``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[tuple, dict] = {}

    def __call__(self, *args: str, nproc: int = 2) -> dict:
        key = (nproc, *args)
        if key not in self.runs:
            out = self.root / f"run{len(self.runs)}"
            self.runs[key] = {**launch("trainer_script.py", out, *args, nproc=nproc), "dir": out}
        return self.runs[key]


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory) -> SharedLaunches:
    return SharedLaunches(tmp_path_factory.mktemp("trainer"))


def ddp_run(trainer_runs: SharedLaunches, world: int) -> dict:
    """Trainer without DeepSpeed: the reference losses and final weights at this world size."""
    return trainer_runs("--ddp", nproc=world)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("world", [2])
@pytest.mark.parametrize("stage", [3])  # stage 2: the bf16 run below
def test_trainer_with_a_deepspeed_config_equals_ddp(trainer_runs, stage, world) -> None:
    result = trainer_runs("--stage", str(stage), nproc=world)
    out = result["dir"]
    assert result["wrapped"] == "zeroshard.engine.engine.Engine" and result["world_size"] == world
    reference = ddp_run(trainer_runs, world)
    assert result["global_step"] == 4 and len(result["losses"]) == 4
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    ours, theirs = final_weights(out / "final"), final_weights(reference["dir"] / "final")
    assert ours.keys() == theirs.keys()
    for name in ours:  # save_model() wrote a from_pretrained-loadable model with the trained weights
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)
    assert (out / "checkpoint-2" / "global_step2" / "manifest.json").is_file()


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow)])  # extended: runs in CI
def test_trainer_bf16(tmp_path, trainer_runs, stage) -> None:
    result = launch("trainer_script.py", tmp_path, "--stage", str(stage), "--bf16")
    assert result["wrapped"] == "zeroshard.engine.engine.Engine"
    losses = torch.tensor(result["losses"])
    torch.testing.assert_close(losses, torch.tensor(ddp_run(trainer_runs, 2)["losses"]), rtol=2e-2, atol=0)
    # save_model() writes the training dtype, as under DeepSpeed
    assert final_weights(tmp_path / "final")["transformer.wte.weight"].dtype == torch.bfloat16


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_trainer_resumes_exactly_at_stage3(tmp_path, trainer_runs) -> None:
    straight = trainer_runs("--stage", "3")  # (the stage-3 run at world 2 compared with DDP)
    resumed = launch("trainer_script.py", tmp_path / "b", "--stage", "3", "--resume",
                     str(straight["dir"] / "checkpoint-2"))
    assert resumed["steps_run"] == 2 and resumed["global_step"] == 4  # it really started at step 2
    assert resumed["losses"][2:] == straight["losses"][2:]  # bitwise: same RNG, data order and state


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_from_pretrained_under_zero_init_at_world2_with_resize(tmp_path, trainer_runs) -> None:
    """Stage 3: from_pretrained builds the model under zero.Init (HfDeepSpeedConfig), resize_token_embeddings
    works on the sharded model, model.dtype / model.device answer, and training matches DDP from the
    same pretrained weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2)) \
        .save_pretrained(tmp_path / "pretrained")
    result = launch("trainer_script.py", tmp_path / "z3", "--stage", "3", "--pretrained", str(tmp_path / "pretrained"))
    assert (result["dtype"], result["device"]) == ("torch.float32", "cpu")
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ddp_run(trainer_runs, 2)["losses"]),
                               rtol=1e-5, atol=0)
    resized = launch("trainer_script.py", tmp_path / "rz", "--stage", "3", "--pretrained", str(tmp_path / "pretrained"),
                     "--resize", "101")
    assert resized["embedding_rows"] == 101
    assert final_weights(tmp_path / "rz" / "final")["transformer.wte.weight"].shape == (101, 32)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_accelerate_loop_with_a_deepspeed_plugin_equals_ddp(tmp_path) -> None:
    """With Accelerate's ``dynamo_backend="inductor"``, which compiles the engine it gets from the
    DeepSpeed door (``engine.compile``): the compiled zeroshard run at ZeRO-3 (its gathers between the
    compiled graphs) equals eager DDP."""
    ours = launch("accelerate_script.py", tmp_path / "ds", "--stage", "3", "--dynamo", "inductor")
    theirs = launch("accelerate_script.py", tmp_path / "ddp", "--ddp")
    assert ours["wrapped"] == "Engine" and theirs["wrapped"] == "DistributedDataParallel"
    assert ours["compiled"], "Accelerate's dynamo_backend did not compile the engine"
    assert ours["processes"] == 2
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-5, atol=0)
