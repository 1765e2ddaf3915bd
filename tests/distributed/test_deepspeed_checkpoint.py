"""Checkpoints written by real DeepSpeed 0.19.8 load into zeroshard and continue as DeepSpeed did.

The fixtures (tests/fixtures/deepspeed/, written by make_fixtures.py under real DeepSpeed on CPU at
world 2; the suite never imports DeepSpeed) are a tiny model (a frozen layer, a buffer) trained 3 AdamW
steps under WarmupLR at ZeRO 0-3, fp32 and bf16, saved with client state, and DeepSpeed's own next 2
steps, and a language model whose output layer's weight is its embedding's (``TiedNet``; ZeRO 2 and 3,
fp32; and at ZeRO 3 with that weight frozen), which DeepSpeed keeps once and names twice
(``shared_params``). Each case loads one into a zeroshard engine with ``engine.load_checkpoint(dir)``:
every parameter's fp32 master and Adam moments equal what DeepSpeed saved bitwise (as its partitions
hold them, unpadded), the counters, the LR schedule, the Adam step and the client state equal
DeepSpeed's, and the next 2 steps on the same batches (through the frozen layer and the buffer, which
zeroshard's model starts from other values of) give DeepSpeed's losses and final fp32 weights to float
rounding (at world 2 the sums are DeepSpeed's, bf16 included; at world 3 a bf16 gradient is summed in
another order). A crafted model file naming a foreign global is refused on every rank by name, with
nothing executed and the engine unchanged. A ``zeroshard convert`` of a fixture loads and continues the
same, and so does a fixture rewritten in DeepSpeed's layout for another world size and stage
(``convert --to deepspeed``) or as DeepSpeed's universal folder (``ds_to_universal``); an engine's save in
DeepSpeed's layout (``checkpoint.format``) writes DeepSpeed's files for its world and loads back
bitwise. DeepSpeed's pipeline fixtures (make_pipe_fixture.py: 2 stages, ZeRO 1, fp32 and bf16) load into
zeroshard's ``PipelineModule`` of the same layers and its MoE fixture (make_moe_fixture.py: 2 experts at
ep_size 2, ZeRO 1) into zeroshard's ``MoE``, with the same checks.

The default suite loads each fixture at world 2 and its own stage, one at another stage, the tied ones
at another stage (the weight still tied in the engine), the crafted file, a converted checkpoint,
the fp32 pipeline fixture at ZeRO 1 and 3, the bf16 one at ZeRO 1, and the MoE fixture at ep_size 2 and
1, in one world; the extended tests load the pipeline fixture at 2 stages x 2 data-parallel ranks and the
MoE fixture at world 4 (each expert on 2 ranks) in one world, and the others at world 3 and other stages
(the same global batch of 6, 2 per rank) and in one process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

import zeroshard
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.deepspeed_format import DeepSpeedReader, deepspeed_directory
from zeroshard.checkpoint.deepspeed_format.convert import convert_deepspeed, convert_to_deepspeed, convert_to_universal
from zeroshard.deepspeed.utils.tensor_fragment import safe_get_full_fp32_param, safe_get_full_optimizer_state
from zeroshard.tools.testing import check_family, run_family

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
_spec = importlib.util.spec_from_file_location("ds_make_fixtures", FIXTURES / "make_fixtures.py")
assert _spec is not None and _spec.loader is not None
make_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixtures)
_spec = importlib.util.spec_from_file_location("ds_make_pipe_fixture", FIXTURES / "make_pipe_fixture.py")
assert _spec is not None and _spec.loader is not None
make_pipe_fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_pipe_fixture)
_spec = importlib.util.spec_from_file_location("ds_make_moe_fixture", FIXTURES / "make_moe_fixture.py")
assert _spec is not None and _spec.loader is not None
make_moe_fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_moe_fixture)


def fixture(case: str) -> tuple[dict[str, Any], dict[str, Any]]:
    meta = json.loads((FIXTURES / case / "meta.json").read_text())
    return meta, torch.load(FIXTURES / case / "continuation.pt", weights_only=True)


def global_batch(inputs: dict[str, torch.Tensor], step: int, saved_world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.cat([inputs[f"x.{step}.{r}"] for r in range(saved_world)]),
            torch.cat([inputs[f"y.{step}.{r}"] for r in range(saved_world)]))


def load_and_continue(rank: int, world: int, case: str, stage: int, source: str = "") -> dict[str, Any]:
    """``source``: where to load from (default: the fixture's DeepSpeed checkpoint; a ``zeroshard
    convert`` of it)."""
    meta, cont = fixture(case)
    config = dict(meta["config"], zero_optimization={"stage": stage})
    per_rank = make_fixtures.PER_RANK_BATCH * meta["world_size"] // world
    config["train_micro_batch_size_per_gpu"] = per_rank
    tied = case.startswith("tied_")
    model = make_fixtures.TiedNet() if tied else make_fixtures.TinyNet()
    if case.startswith("tied_frozen_"):
        model.embed.weight.requires_grad_(False)
    engine = zeroshard.initialize(model=model, config=config)[0]
    path, client = engine.load_checkpoint(source or str(FIXTURES / case / "checkpoint"))
    loaded = {name: {"param": safe_get_full_fp32_param(p).clone(),
                     **{k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")}}
              for name, p in engine.module.named_parameters() if p.requires_grad}
    out: dict[str, Any] = {
        "path": str(path), "loaded": loaded, "global_steps": engine.global_steps,
        "global_samples": engine.global_samples, "scheduler": engine.lr_scheduler.state_dict(),
        "lr": [g["lr"] for g in engine.optimizer.param_groups], "client": {k: client[k] for k in meta["client_state"]},
        "losses": []}
    dtype = torch.bfloat16 if meta["bf16"] else torch.float32
    for step in range(meta["saved_steps"], meta["saved_steps"] + meta["next_steps"]):
        x, y = global_batch(cont["inputs"], step, meta["world_size"])
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        if tied:
            loss = make_fixtures.tied_loss(engine, x[mine], y[mine])
        else:
            loss = torch.nn.functional.mse_loss(engine(x[mine].to(dtype)).float(), y[mine])
        engine.backward(loss)
        engine.step()
        out["losses"].append(float(loss.detach()))
    out["weights"] = {name: safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()
                      if p.requires_grad}
    out["tied"] = not tied or engine.module.head.weight is engine.module.embed.weight
    engine.close()
    return out


def check_load_and_continue(results: list[dict[str, Any]], case: str, stage: int, source: str = "") -> None:
    meta, cont = fixture(case)
    saved = DeepSpeedReader(deepspeed_directory(FIXTURES / case / "checkpoint", None))
    world = len(results)
    for rank, got in enumerate(results):
        assert got["path"].endswith(meta["tag"])
        for name, keys in got["loaded"].items():
            for key, value in keys.items():
                assert torch.equal(value.reshape(-1), saved.read(name, "param" if key == "param" else f"optim.{key}")), \
                    f"rank {rank}: {name}'s {key} differs from DeepSpeed's"
        assert (got["global_steps"], got["global_samples"]) == (3, 18)
        assert got["scheduler"] == {"last_batch_iteration": 2}
        assert got["client"] == meta["client_state"]
        assert got["tied"], f"rank {rank}: the output layer's weight is no longer the embedding's"
    ranks_losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64)  # [rank, step]
    mean_loss = ranks_losses.mean(0)
    expected = cont["losses"].mean(1)  # DeepSpeed's ranks' mean per step
    same_world = world == meta["world_size"]  # the same sums in the same order: DeepSpeed's numbers
    rtol = 5e-3 if meta["bf16"] and not same_world else 1e-6
    assert torch.allclose(mean_loss, expected, rtol=rtol, atol=0), f"losses {mean_loss.tolist()} != {expected.tolist()}"
    if same_world:
        assert torch.allclose(ranks_losses.T, cont["losses"], rtol=rtol, atol=0)
    atol = 1e-3 if meta["bf16"] and not same_world else 1e-6
    for name, value in results[0]["weights"].items():
        diff = (value - cont["weights"][name]).abs().max().item()
        assert diff <= atol, f"{name} after the continuation differs from DeepSpeed's by {diff}"


def crafted_refused(rank: int, world: int, directory: str) -> dict[str, Any]:
    """A copy of a fixture whose model file names ``posix.system``: refused, nothing run, engine as it was."""
    root = Path(directory)
    marker = root / "ran"
    engine = zeroshard.initialize(model=make_fixtures.TinyNet(), config=fixture("zero2_fp32")[0]["config"])[0]
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    try:
        engine.load_checkpoint(str(root / "checkpoint"))
        error = ""
    except CheckpointError as err:
        error = str(err)
    same = all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    engine.close()
    return {"error": error, "ran": marker.exists(), "same": same, "steps": 0}


class Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def make_crafted(directory: Path) -> None:
    shutil.copytree(FIXTURES / "zero2_fp32" / "checkpoint", directory / "checkpoint")
    model_file = directory / "checkpoint" / "step3" / "mp_rank_00_model_states.pt"
    state = torch.load(model_file, weights_only=True)
    state["payload"] = Exploit(str(directory / "ran"))
    torch.save(state, model_file)


def check_crafted(results: list[dict[str, Any]], directory: str) -> None:
    for got in results:
        assert ("posix.system" in got["error"] and "refused" in got["error"]) or "failed validation" in got["error"], \
            got["error"]
        assert not got["ran"] and got["same"]
    assert any("posix.system" in got["error"] for got in results)


def saved_as_deepspeed(rank: int, world: int, directory: str) -> dict[str, Any]:
    """An engine at stage 3 with ``"checkpoint": {"format": "deepspeed"}`` loads the zero2_bf16 fixture and
    saves it: the files are DeepSpeed's stage-3 layout for this world, and an engine at stage 1 loads them
    back bitwise.  An asynchronous save in that layout is refused."""
    meta, _ = fixture("zero2_bf16")
    engines = [zeroshard.initialize(model=make_fixtures.TinyNet(), config=dict(
        meta["config"], zero_optimization={"stage": stage}, checkpoint={"format": layout}))[0]
        for stage, layout in ((3, "deepspeed"), (1, "zeroshard"))]
    engines[0].load_checkpoint(str(FIXTURES / "zero2_bf16" / "checkpoint"))
    try:
        engines[0].save_checkpoint(directory, tag="never", async_save=True)
        refused = False
    except ValueError as err:
        refused = "synchronously" in str(err)
    target = engines[0].save_checkpoint(directory, tag="as_ds", client_state={"epoch": 5})
    _, client = engines[1].load_checkpoint(directory)
    state = [{n: (safe_get_full_fp32_param(p).clone(), safe_get_full_optimizer_state(p, "exp_avg_sq").clone())
              for n, p in e.module.named_parameters() if p.requires_grad} for e in engines]
    same = all(torch.equal(a, b) for n in state[0] for a, b in zip(state[0][n], state[1][n]))
    out = {"files": sorted(p.name for p in Path(target).iterdir()), "same": same, "epoch": client["epoch"],
           "refused": refused, "tags": sorted(p.name for p in Path(directory).iterdir()),
           "steps": engines[1].global_steps, "staging_left": any(p.name.startswith(".") for p in Path(directory).iterdir())}
    for engine in engines:
        engine.close()
    return out


def check_saved_as_deepspeed(results: list[dict[str, Any]], directory: str) -> None:
    world = len(results)
    expected = sorted([f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
                      + [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)])
    for got in results:
        assert got["files"] == expected and got["same"] and not got["staging_left"] and got["refused"], got
        assert got["tags"] == ["as_ds", "latest"], got
        assert (got["epoch"], got["steps"]) == (5, 3)


def pipe_load_and_continue(rank: int, world: int, case: str, stage: int) -> dict[str, Any]:
    """DeepSpeed's pipeline fixture loaded into zeroshard's ``PipelineModule`` of the same layers (2
    stages, ``world // 2`` data-parallel ranks each: the same global batch of 2 micro-batches of 3) at
    ZeRO ``stage``, then its next batches."""
    from zeroshard.pipeline import LayerSpec, PipelineModule
    meta, cont = fixture(case)
    dp = world // meta["stages"]
    config = dict(meta["config"], zero_optimization={"stage": stage},
                  gradient_accumulation_steps=make_pipe_fixture.MICRO_BATCHES // dp)
    module = PipelineModule(layers=make_pipe_fixture.layers(LayerSpec),
                            loss_fn=make_pipe_fixture.loss_fn if meta["bf16"] else torch.nn.MSELoss(),
                            num_stages=meta["stages"], partition_method="uniform")
    engine = zeroshard.initialize(model=module, model_parameters=module.parameters(), config=config)[0]
    path, client = engine.load_checkpoint(str(FIXTURES / case / "checkpoint"))

    def full(keys: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
        return {module.global_name(n): {k: (safe_get_full_fp32_param(p) if k == "param" else
                                            safe_get_full_optimizer_state(p, k)).clone() for k in keys}
                for n, p in engine.module.named_parameters() if p.requires_grad}
    out: dict[str, Any] = {"path": str(path), "loaded": full(("param", "exp_avg", "exp_avg_sq")),
                           "global_steps": engine.global_steps, "scheduler": engine.lr_scheduler.state_dict(),
                           "client": {k: client[k] for k in meta["client_state"]}, "losses": []}
    micro = list(range(make_pipe_fixture.MICRO_BATCHES))[rank % dp::dp]
    for step in range(meta["saved_steps"], meta["saved_steps"] + meta["next_steps"]):
        dtype = torch.bfloat16 if meta["bf16"] else torch.float32
        batches = iter([(cont["inputs"][f"x.{step}.{m}"].to(dtype), cont["inputs"][f"y.{step}.{m}"]) for m in micro])
        out["losses"].append(float(engine.train_batch(batches)))
    out["weights"] = {k: v["param"] for k, v in full(("param",)).items()}
    engine.close()
    return out


def check_pipe_load_and_continue(results: list[dict[str, Any]], case: str, stage: int,
                                 losses_by_rank: bool = False) -> None:
    """``losses_by_rank``: the fixture recorded each rank's loss (not the batch's, on every rank): at its
    world size each rank's equals DeepSpeed's, at another the ranks' mean equals DeepSpeed's ranks'."""
    meta, cont = fixture(case)
    saved = DeepSpeedReader(deepspeed_directory(FIXTURES / case / "checkpoint", None))
    weights: dict[str, torch.Tensor] = {}
    for rank, got in enumerate(results):
        assert got["path"].endswith(meta["tag"])
        for name, keys in got["loaded"].items():
            for key, value in keys.items():
                assert torch.equal(value.reshape(-1), saved.read(name, "param" if key == "param" else f"optim.{key}")), \
                    f"rank {rank}: {name}'s {key} differs from DeepSpeed's"
        assert got["global_steps"] == 3 and got["scheduler"] == {"last_batch_iteration": 2}
        assert got["client"] == meta["client_state"]
        if losses_by_rank and len(results) == meta["world_size"]:
            expected = cont["losses"][:, rank]
        elif losses_by_rank:
            expected = cont["losses"].mean(1)
            got = dict(got, losses=torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0).tolist())
        else:
            expected = cont["losses"]
        assert torch.allclose(torch.tensor(got["losses"], dtype=torch.float64), expected, rtol=1e-6, atol=0), \
            f"rank {rank}: losses {got['losses']} != {expected.tolist()}"
        weights.update(got["weights"])
    assert sorted(weights) == sorted(cont["weights"]) == sorted(saved.param_names())
    for name, value in weights.items():
        diff = (value - cont["weights"][name]).abs().max().item()
        assert diff <= 1e-6, f"{name} after the continuation differs from DeepSpeed's by {diff}"


def moe_load_and_continue(rank: int, world: int, case: str, stage: int, ep_size: int) -> dict[str, Any]:
    """DeepSpeed's MoE fixture loaded into zeroshard's ``MoE`` of the same shapes at ``ep_size`` and ZeRO
    ``stage``, then its next steps on the same global batch, an equal share per rank; every expert under
    its global name."""
    from zeroshard.deepspeed.moe.layer import MoE
    from zeroshard.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    meta, cont = fixture(case)
    torch.manual_seed(rank)  # every rank's weights other than DeepSpeed's: the load must set them all
    model = make_moe_fixture.MoENet(MoE, ep_size)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "parameters"})
    config = dict(meta["config"], zero_optimization={"stage": stage},
                  train_micro_batch_size_per_gpu=make_moe_fixture.PER_RANK_BATCH * meta["world_size"] // world)
    engine = zeroshard.initialize(model=model, model_parameters=groups, config=config)[0]
    path, client = engine.load_checkpoint(str(FIXTURES / case / "checkpoint"))
    local, per_rank = "deepspeed_moe.experts.deepspeed_experts.", make_moe_fixture.EXPERTS // ep_size
    per_batch = make_moe_fixture.PER_RANK_BATCH * meta["world_size"] // world

    def full(keys: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for name, p in engine.module.named_parameters():
            head, found, tail = name.partition(local)
            index, _, rest = tail.partition(".")
            global_name = f"{head}{local}{(rank % ep_size) * per_rank + int(index)}.{rest}" if found else name
            out[global_name] = {k: (safe_get_full_fp32_param(p) if k == "param" else
                                    safe_get_full_optimizer_state(p, k)).clone() for k in keys}
        return out
    out: dict[str, Any] = {"path": str(path), "loaded": full(("param", "exp_avg", "exp_avg_sq")),
                           "global_steps": engine.global_steps, "scheduler": engine.lr_scheduler.state_dict(),
                           "client": {k: client[k] for k in meta["client_state"]}, "losses": []}
    for step in range(meta["saved_steps"], meta["saved_steps"] + meta["next_steps"]):
        x, y = global_batch(cont["inputs"], step, meta["world_size"])
        x, y = x[rank * per_batch:(rank + 1) * per_batch], y[rank * per_batch:(rank + 1) * per_batch]
        loss = make_moe_fixture.loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        out["losses"].append(float(loss.detach()))
    out["weights"] = {k: v["param"] for k, v in full(("param",)).items()}
    engine.close()
    return out


def check_moe_load_and_continue(results: list[dict[str, Any]], case: str, stage: int, ep_size: int) -> None:
    check_pipe_load_and_continue(results, case, stage, losses_by_rank=True)


WORKERS = {"load": load_and_continue, "moe_load": moe_load_and_continue, "pipe_load": pipe_load_and_continue, "crafted": crafted_refused, "as_deepspeed": saved_as_deepspeed}
CHECKS = {"load": check_load_and_continue, "moe_load": check_moe_load_and_continue, "pipe_load": check_pipe_load_and_continue, "crafted": check_crafted, "as_deepspeed": check_saved_as_deepspeed}
CASES = tuple(f"zero{stage}_{precision}" for precision in ("fp32", "bf16") for stage in range(4))
PIPE_CASE = "pipe2_zero1_fp32"
PIPE_BF16_CASE = "pipe2_zero1_bf16"
MOE_CASE = "moe_ep2_zero1_fp32"


def test_deepspeed_checkpoints_at_world_2() -> None:
    family = [("load", {"case": case, "stage": int(case[4])}) for case in CASES]
    family.append(("load", {"case": "zero3_fp32", "stage": 1}))
    family += [("load", {"case": "tied_zero3_fp32", "stage": 2}), ("load", {"case": "tied_zero2_fp32", "stage": 3}),
               ("load", {"case": "tied_frozen_zero3_fp32", "stage": 2})]
    family += [("pipe_load", {"case": PIPE_CASE, "stage": stage}) for stage in (1, 3)]
    family.append(("pipe_load", {"case": PIPE_BF16_CASE, "stage": 1}))
    family += [("moe_load", {"case": MOE_CASE, "stage": stage, "ep_size": ep}) for stage, ep in ((1, 2), (2, 1))]
    with tempfile.TemporaryDirectory() as tmp:
        crafted = Path(tmp) / "crafted"
        make_crafted(crafted)
        converted = Path(tmp) / "converted"
        convert_deepspeed(FIXTURES / "zero2_bf16" / "checkpoint", converted)
        written = Path(tmp) / "written"
        convert_to_deepspeed(FIXTURES / "zero3_fp32" / "checkpoint", written, 3, 1)  # another world and stage
        universal = Path(tmp) / "universal"
        convert_to_universal(FIXTURES / "zero1_bf16" / "checkpoint", universal)
        family_with_crafted = [*family, ("crafted", {"directory": str(crafted)}),
                               ("load", {"case": "zero2_bf16", "stage": 3, "source": str(converted)}),
                               ("load", {"case": "zero3_fp32", "stage": 2, "source": str(written)}),
                               ("load", {"case": "zero1_bf16", "stage": 3, "source": str(universal)}),
                               ("as_deepspeed", {"directory": str(Path(tmp) / "as_ds")})]
        check_family(family_with_crafted, run_family(2, family_with_crafted, WORKERS), CHECKS, world=2)


@pytest.mark.slow
def test_deepspeed_checkpoints_at_world_3_other_stages() -> None:
    family = [("load", {"case": case, "stage": stage}) for case, stage in (
        ("zero0_fp32", 2), ("zero0_bf16", 3), ("zero1_fp32", 3), ("zero2_fp32", 2), ("zero3_fp32", 2), ("zero2_bf16", 3), ("zero3_bf16", 1))]
    check_family(family, run_family(3, family, WORKERS), CHECKS, world=3)


@pytest.mark.slow
def test_deepspeed_pipeline_and_moe_checkpoints_at_world_4() -> None:
    """The pipeline fixture (2 stages x 1) at 2 stages x 2 data-parallel ranks, ZeRO 2; the MoE fixture
    (world 2, ep_size 2) at world 4, ep_size 2 (each expert on 2 ranks), ZeRO 1."""
    family = [("pipe_load", {"case": PIPE_CASE, "stage": 2}),
              ("moe_load", {"case": MOE_CASE, "stage": 1, "ep_size": 2})]
    check_family(family, run_family(4, family, WORKERS), CHECKS, world=4)


@pytest.mark.slow
def test_deepspeed_checkpoints_in_one_process() -> None:
    """World 1, no process group: the whole global batch of 6 on one rank."""
    for case, stage in (("zero3_bf16", 2), ("zero1_fp32", 3)):
        check_load_and_continue([load_and_continue(0, 1, case, stage)], case, stage)
