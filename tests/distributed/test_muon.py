"""Muon at every ZeRO stage: each matrix stepped whole on the rank that owns it, equal to one process.

A small model with a tied embedding (17 x 10, stepped by AdamW as DeepSpeed's split says), two hidden
matrices of odd shapes (24 x 10 and 10 x 24, Muon's) and 1-D biases and norms (AdamW's) trains 3 steps
with the config's ``"optimizer": {"type": "Muon"}`` at stages 0-3 in a world of two.  The oracle is one
process on the global batch running ``torch.optim.Muon`` on the matrices and ``torch.optim.AdamW`` on the
rest with the same hyperparameters.

Tolerances: with torch's Newton-Schulz in fp32 (patched in both, ``_zeropower_via_newtonschulz``)
the result equals the oracle to 1e-5: the only difference left is the order of the gradient average
over ranks.  With torch's own bf16 iteration, that fp32 difference in the averaged gradient may round
some bf16 elements of the iteration the other way; one bf16 rounding is 2^-8 relative on an update
whose entries are at most about 1 in size, so after ``STEPS`` steps the matrices agree to within
``STEPS * adjusted lr * 2^-7`` (and the AdamW parameters, which see the matrices through the loss,
to the same order); the fp32 case shows that this rounding is all there is.  Each case also checks that
the matrices did not get AdamW's update (Muon really active at stage 0 and under ``zeroshard.Init``,
where the ``use_muon`` marks the user set on the Init parameters are honoured), Muon's momentum as
``safe_get_full_optimizer_state`` returns it, the model-state bytes
of ``memory_breakdown()`` against the formula with Muon's momentum 1/N, and the ledger's
``all_to_all`` bytes against [Note: whole matrices, each on one rank] in zeroshard/optim/whole_matrices.py.
Also equal to one process: the client ``MuonWithAuxAdam``, ``torch.optim.Adafactor`` (fp32, 1e-5), CPU
offload, bf16 (within bf16's rounding), gradient accumulation with clipping, DeepSpeed's MoE layer at
ep 2 (the experts' matrices stepped over the ranks that hold them); a checkpoint saved at stage 1
resumes at stage 3 with Muon's momentum, one saved at stage 0 (where every rank holds the whole bucket)
at stage 2, one of Adafactor saved at stage 3 at stage 0 with its factored moments and step, and one of
the MoE model at stage 3 with its experts' momentum.
Refused by name on every rank: no 2-D parameter, an unknown ``ns_method``, ``use_muon`` on a 1-D parameter.
The extended test runs the world of three, checkpoints across worlds, and a DeepSpeed script under
``zeroshard run --as-deepspeed``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from zeroshard.config import ConfigError
from zeroshard.deepspeed.utils.tensor_fragment import safe_get_full_optimizer_state
from zeroshard.optim.muon import MuonWithAuxAdam, NoMatrixError, UseMuonMarkError
from zeroshard.tools.testing import check_family, run_family

V, D, H, ROWS, SEQ, STEPS = 17, 10, 24, 2, 5, 3
PARAMS = {"lr": 0.01, "muon_lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9, "weight_decay": 0.1,
          "betas": [0.9, 0.99], "eps": 1e-8, "ns_method": "standard"}
MATRICES = ("up.weight", "down.weight")


class Tiny(nn.Module):
    """A tied embedding, a 24 x 10 and a 10 x 24 matrix, biases and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.down(torch.tanh(self.up(h)))
        return F.cross_entropy(self.lm_head(self.norm(h)).flatten(0, 1), y.flatten())


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, V, (ROWS * world, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def fp32_newton_schulz(grad: torch.Tensor, ns_coefficients: tuple, ns_steps: int, eps: float) -> torch.Tensor:
    """torch's iteration, in fp32 (the bound's witness: see the module's docstring)."""
    a, b, c = ns_coefficients
    x = grad.float().T if grad.size(0) > grad.size(1) else grad.float().clone()
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def use_newton_schulz(ns: str) -> None:
    import torch.optim._muon as muon_module
    if not hasattr(muon_module, "_bf16_newton_schulz"):
        setattr(muon_module, "_bf16_newton_schulz", muon_module._zeropower_via_newtonschulz)
    muon_module._zeropower_via_newtonschulz = (fp32_newton_schulz if ns == "fp32"
                                               else getattr(muon_module, "_bf16_newton_schulz"))


def oracle(ns: str, adam_everywhere: bool = False, client: str = "", world: int = 2,
           worlds: tuple[int, ...] = (), clip: float = 0.0) -> dict[str, torch.Tensor]:
    """One process, the global batch: torch.optim.Muon on the matrices, torch.optim.AdamW on the rest
    (``client="adafactor"``: torch.optim.Adafactor on everything); ``worlds``: each step's world size
    where it changes (a checkpoint loaded at another world); ``clip``: the gradient norm is clipped."""
    use_newton_schulz(ns)
    torch.manual_seed(0)
    model = Tiny()
    named = dict(model.named_parameters())
    muon_names = () if adam_everywhere else MATRICES
    opts: list[torch.optim.Optimizer] = [client_optimizer(model, client)] if client == "adafactor" else [torch.optim.AdamW(
        [p for n, p in named.items() if n not in muon_names], lr=PARAMS["adam_lr"], betas=tuple(PARAMS["betas"]),
        eps=PARAMS["eps"], weight_decay=PARAMS["weight_decay"])]
    if muon_names and client != "adafactor":
        opts.append(torch.optim.Muon([named[n] for n in muon_names], lr=PARAMS["muon_lr"],
                                     momentum=PARAMS["momentum"], weight_decay=PARAMS["weight_decay"],
                                     nesterov=True, adjust_lr_fn="original"))
    for step in range(STEPS):
        model(*batch(step, worlds[step] if worlds else world)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    use_newton_schulz("bf16")  # torch's own again, for whatever runs next in this process
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    if muon_names and client != "adafactor":
        out.update({f"momentum:{n}": opts[1].state[named[n]]["momentum_buffer"] for n in muon_names})
    return out


def momenta(model: nn.Module) -> dict[str, torch.Tensor]:
    """Muon's momentum of each matrix, through DeepSpeed's tensor-fragment function (a collective)."""
    named = dict(model.named_parameters())
    return {f"momentum:{n}": safe_get_full_optimizer_state(named[n], "momentum_buffer") for n in MATRICES}


def client_optimizer(model: nn.Module, client: str) -> torch.optim.Optimizer:
    """The client optimizers: MuonWithAuxAdam's use_muon groups (the Muon ecosystem's convention), or
    torch.optim.Adafactor over every parameter."""
    if client == "adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=0.01, weight_decay=0.1)
    named = dict(model.named_parameters())
    return MuonWithAuxAdam([
        {"params": [named[n] for n in MATRICES], "use_muon": True, "lr": PARAMS["muon_lr"],
         "momentum": PARAMS["momentum"], "weight_decay": PARAMS["weight_decay"]},
        {"params": [p for n, p in named.items() if n not in MATRICES], "use_muon": False, "lr": PARAMS["adam_lr"],
         "betas": tuple(PARAMS["betas"]), "eps": PARAMS["eps"], "weight_decay": PARAMS["weight_decay"]}])


def train(rank: int, world: int, stage: int, ns: str, init: bool = False, client: str = "",
          offload: bool = False, bf16: bool = False, clip: float = 0.0, bucket: int = 200) -> dict[str, Any]:
    """``clip``: gradient clipping, with 2 micro steps of one row each per optimizer step; ``bucket``:
    the reduce bucket size (200 cuts each matrix over the chunks, 1000 holds both whole in one bucket)."""
    use_newton_schulz(ns)
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": ROWS, "optimizer": {"type": "Muon", "params": PARAMS},
                              "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket}}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if bf16:
        config["bf16"] = {"enabled": True}
    if client:
        del config["optimizer"]
    if clip:
        config.update(gradient_clipping=clip, train_micro_batch_size_per_gpu=ROWS // 2, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    if init:
        with zeroshard.Init(config=config):
            model = Tiny()
        for name, p in model.named_parameters():  # the user's marks, on the Init parameters
            p.use_muon = name in MATRICES  # type: ignore[attr-defined]
    else:
        model = Tiny()
    optimizer = client_optimizer(model, client) if client else None
    engine, _, _, _ = zeroshard.initialize(model=model, optimizer=optimizer, config=config)
    log = engine.comm.ledger.start_log()
    for step in range(STEPS):
        x, y = batch(step, world)
        x, y = x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]
        for micro in (range(2) if clip else [None]):
            rows = slice(None) if micro is None else slice(micro, micro + 1)
            engine.backward(engine(x[rows], y[rows]))
            engine.step()
    matrices = [r for r in log if r.label.startswith("matrices_")]
    params = {k: v.float() for k, v in engine.full_state_dict(rank0_only=False).items()}
    if client != "adafactor":
        params.update(momenta(model))
    assert engine.updater.matrices is not None
    sent, away, whole = noted_count(engine.updater.matrices.plans, rank)
    return {"params": params, "memory": engine.memory_breakdown(), "noted_sent": sent, "away": away,
            "whole": whole, "matrix_bytes": sum(r.sent for r in matrices),
            "matrix_labels": sorted({r.label for r in matrices})}


def noted_count(plans: dict[int, Any], rank: int) -> tuple[int, int, int]:
    """The note's count from the layout and the owners alone: (elements ``rank`` sends per step, A the
    matrices' elements outside their owner's chunk, M the matrices' elements).  Stages 1-3: a rank
    sends twice what it holds of others' matrices and once the parts of its own held elsewhere; stage
    0: each owner sends its matrices to the N-1 others."""
    sent = away = whole = 0
    for plan in plans.values():
        n, c = plan.world_size, plan.chunk_numel
        for s in plan.bucket.slots:
            owner = plan.owners[s.index]
            whole += s.numel
            if plan.whole:
                sent += s.numel * (n - 1) if owner == rank else 0
                continue
            held = [max(0, min((r + 1) * c, s.offset + s.numel) - max(r * c, s.offset)) for r in range(n)]
            away += s.numel - held[owner]
            sent += s.numel - held[owner] if owner == rank else 2 * held[rank]
    return sent, away, whole


def resume(rank: int, world: int, save_stage: int, load_stage: int, path: str, phase: str = "both",
           worlds: tuple[int, ...] = (), client: str = "") -> dict[str, Any]:
    """Two steps at ``save_stage`` and a checkpoint (``phase`` "save"), then a fresh engine at
    ``load_stage`` loads it and takes the third step ("load"); "both" does both in this world.
    ``client="adafactor"``: torch.optim.Adafactor, whose factored moments and step the checkpoint holds."""
    use_newton_schulz("fp32")
    out: dict[str, Any] = {"params": {}}
    phases = [("save", save_stage, range(STEPS - 1)), ("load", load_stage, range(STEPS - 1, STEPS))]
    for name, stage, steps in phases if phase == "both" else [p for p in phases if p[0] == phase]:
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": ROWS,
                                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 150}}
        if not client:
            config["optimizer"] = {"type": "Muon", "params": PARAMS}
        torch.manual_seed(0 if name == "save" else 1)  # the loaded engine starts from other values
        model = Tiny()
        optimizer = client_optimizer(model, client) if client else None
        engine, _, _, _ = zeroshard.initialize(model=model, optimizer=optimizer, config=config)
        if name == "load":
            engine.load_checkpoint(path, tag="t")
        for step in steps:
            x, y = batch(step, world)
            engine.backward(engine(x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]))
            engine.step()
        if name == "save":
            engine.save_checkpoint(path, tag="t")
        else:
            out["params"] = {**engine.full_state_dict(rank0_only=False), **({} if client else momenta(engine.module))}
        engine.close()
    return out


def check_resume(by_rank: list[dict[str, Any]], save_stage: int, load_stage: int, path: str, phase: str = "both",
                 worlds: tuple[int, ...] = (), client: str = "") -> None:
    if phase == "save":
        return
    want = oracle("fp32", client=client, world=len(by_rank), worlds=worlds)
    for result in by_rank:
        for name, value in want.items():
            err = float((result["params"][name] - value).abs().max())
            assert err <= 1e-5, f"{name}: {err:.3g} from one process after the reload"


def experts(rank: int, world: int, stage: int, path: str = "") -> dict[str, Any]:
    """DeepSpeed's MoE layer at ep 2 x data 1 (each rank two of the four experts) with the config's Muon:
    the experts' matrices (DeepSpeed's rule marks them, and the gate's and the head's) stepped whole
    over the ranks that hold the same experts, the rest over both ranks.  ``path``: a checkpoint after
    the second step, loaded by a fresh engine that takes the third (the experts' momentum with it)."""
    import test_expert_parallel as ep_test
    use_newton_schulz("fp32")
    extra = {"optimizer": {"type": "Muon", "params": PARAMS}}
    engine, _ = ep_test.engine_for(rank, stage, 2, 2, True, extra)
    for step in range(STEPS):
        if path and step == STEPS - 1:
            engine.save_checkpoint(path, tag="t")
            engine.close()
            engine, _ = ep_test.engine_for(rank, stage, 2, 2, True, extra)
            engine.load_checkpoint(path, tag="t")
        engine.backward(engine(*ep_test.batch(step, rank)))
        engine.step()
    state = engine.full_state_dict(rank0_only=False)  # every expert, under its global name
    engine.close()
    return {"state": state}


def check_experts(by_rank: list[dict[str, Any]], stage: int, path: str = "") -> None:
    """One process holding every expert, each rank's batch routed apart and the losses averaged, with
    torch.optim.Muon on DeepSpeed's matrices and AdamW on the rest (fp32 Newton-Schulz: 1e-5)."""
    import test_expert_parallel as ep_test
    use_newton_schulz("fp32")
    model = ep_test.reference_model(2, True)
    named = dict(model.named_parameters())
    matrices = [n for n, p in named.items() if p.dim() >= 2 and "embed" not in n and "lm_head" not in n]
    opts = [torch.optim.Muon([named[n] for n in matrices], lr=PARAMS["muon_lr"], momentum=PARAMS["momentum"],
                             weight_decay=PARAMS["weight_decay"], adjust_lr_fn="original"),
            torch.optim.AdamW([p for n, p in named.items() if n not in matrices], lr=PARAMS["adam_lr"],
                              betas=tuple(PARAMS["betas"]), eps=PARAMS["eps"], weight_decay=PARAMS["weight_decay"])]
    for step in range(STEPS):
        (sum(model(*ep_test.batch(step, r)) for r in range(len(by_rank))) / len(by_rank)).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    use_newton_schulz("bf16")
    assert any("deepspeed_experts" in n for n in matrices)
    for result in by_rank:
        for name, value in model.state_dict().items():
            err = float((result["state"][name] - value).abs().max())
            assert err <= 1e-5, f"{name}: {err:.3g} from one process"


def refused(rank: int, world: int) -> dict[str, str]:
    """Each bad input's error class, on this rank."""
    out = {}
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon"}, "zero_optimization": {"stage": 2}}
    for label, build in (("no matrix", lambda: nn.Sequential(nn.LayerNorm(4))),
                         ("1-D mark", lambda: _marked_bias())):
        try:
            zeroshard.initialize(model=build(), config=config)
            out[label] = "accepted"
        except (NoMatrixError, UseMuonMarkError) as err:
            out[label] = type(err).__name__
    try:
        zeroshard.initialize(model=Tiny(), config={**config, "optimizer": {"type": "Muon",
                                                                           "params": {"ns_method": "cubic"}}})
        out["ns_method"] = "accepted"
    except ConfigError as err:
        out["ns_method"] = type(err).__name__ + (": names it" if "ns_method" in str(err) else "")
    return out


def _marked_bias() -> nn.Module:
    model = nn.Linear(4, 4)
    model.bias.use_muon = True  # type: ignore[attr-defined]
    return model


def check_train(by_rank: list[dict[str, Any]], stage: int, ns: str, init: bool = False, client: str = "",
                offload: bool = False, bf16: bool = False, clip: float = 0.0, bucket: int = 200) -> None:
    n = len(by_rank)
    want = oracle(ns, client=client, world=n, clip=clip)
    adam = oracle(ns, adam_everywhere=True, world=n)
    adjusted = PARAMS["muon_lr"] * math.sqrt(max(1, H / D))
    tol = 1e-5 if ns == "fp32" else STEPS * adjusted * 2 ** -7
    if bf16:  # bf16 parameters and activations: a few roundings of 2^-8 of values of about 1, per step
        tol = STEPS * 2 ** -6
    for result in by_rank:
        got = result["params"]
        for name, value in want.items():
            err = float((got[name] - value).abs().max())
            assert err <= tol, f"{name}: {err:.3g} from one process (bound {tol:.3g})"
        for name in MATRICES if client != "adafactor" and not bf16 else ():  # a matrix stepped by AdamW lands far from Muon's
            assert float((got[name] - adam[name]).abs().max()) > 20 * tol, f"{name} got AdamW's update"
    numel = {name: p.numel() for name, p in want.items() if not name.startswith("momentum:")}
    muon = sum(numel[k] for k in MATRICES)
    rest = sum(numel.values()) - muon
    # the ledger's all-to-all bytes: each rank's exactly the note's count from the layout and owners
    away, whole = by_rank[0]["away"], by_rank[0]["whole"]
    for result in by_rank:
        assert result["matrix_bytes"] == STEPS * 4 * result["noted_sent"], (result["matrix_bytes"], result["noted_sent"])
    total = sum(r["matrix_bytes"] for r in by_rank) / STEPS
    assert total == (3 * away if stage >= 1 else whole * (n - 1)) * 4, (total, away, whole)
    if client != "adafactor" and stage >= 1 and n == 2:
        # buckets of 200 cut each matrix in two halves (A = M/2); one bucket of 1000 holds both whole,
        # each in one rank's chunk, and the owner is that rank (nothing travels)
        assert away == (0 if bucket >= 2 * muon and stage < 3 else muon // 2), (away, muon, bucket)
    if client == "adafactor" or offload or bf16 or n != 2:  # the sum where ownership is not even per rank
        states = sum(r["memory"]["model_states"] - r["memory"]["formula"] for r in by_rank)
        assert states == pytest.approx(0, abs=16 * n)
        return
    for result in by_rank:
        memory = result["memory"]
        # fp32: AdamW's two state tensors per element, 1/N from stage 1; Muon's momentum 1/N at every stage
        expected = 8 * rest / (n if stage >= 1 else 1) + 4 * muon / n
        assert abs(memory["optimizer"] - expected) <= 8 * n, (memory["optimizer"], expected)
        assert memory["model_states"] - memory["formula"] == pytest.approx(0, abs=16 * n)


def check_refused(by_rank: list[dict[str, str]]) -> None:
    for result in by_rank:
        assert result == {"no matrix": "NoMatrixError", "1-D mark": "UseMuonMarkError",
                          "ns_method": "ConfigError: names it"}, result





def family(world: int) -> list[tuple[str, dict[str, Any]]]:
    cases: list[tuple[str, dict[str, Any]]] = []
    for stage in (0, 1, 2, 3):
        cases += [("train", {"stage": stage, "ns": "fp32", **({"bucket": 1000} if stage == 1 else {})})]
    cases += [("train", {"stage": 3, "ns": "bf16"})]
    cases += [("train", {"stage": 3, "ns": "fp32", "init": True}),
              ("train", {"stage": 1, "ns": "fp32", "client": "muon"}),
              ("train", {"stage": 2, "ns": "fp32", "client": "adafactor"}),
              ("train", {"stage": 3, "ns": "fp32", "offload": True}),
              ("train", {"stage": 2, "ns": "fp32", "bf16": True}),
              ("train", {"stage": 2, "ns": "fp32", "clip": 0.05}),
              ("experts", {"stage": 2}),
              ("refused", {})]
    return cases


def test_muon_matches_one_process_at_every_stage(tmp_path: Any) -> None:
    cases = family(2) + [("resume", {"save_stage": 1, "load_stage": 3, "path": str(tmp_path / "a")}),
                         ("resume", {"save_stage": 0, "load_stage": 2, "path": str(tmp_path / "z")}),
                         ("experts", {"stage": 3, "path": str(tmp_path / "e")}),
                         ("resume", {"save_stage": 3, "load_stage": 0, "path": str(tmp_path / "f"),
                                     "client": "adafactor"})]
    check_family(cases, run_family(2, cases, WORKERS), CHECKS, world=2)


def script_native(rank: int, world: int, config: str, out: str) -> None:
    """The DeepSpeed-style script's ``--native`` path (zeroshard's own API), 3 steps."""
    import importlib.util
    import sys

    from test_ds_scripts import SCRIPT
    spec = importlib.util.spec_from_file_location("train_ds_style", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv, sys.argv = sys.argv, [str(SCRIPT), "--deepspeed", "--deepspeed_config", config, "--out", out,
                                "--steps", "3", "--native"]
    try:
        script.main()
    finally:
        sys.argv = argv


def run_script_as_deepspeed(config: Path, out: Path) -> list[float]:
    """The script, saying ``import deepspeed``, under ``zeroshard run --as-deepspeed`` at world 2: its losses."""
    import json
    import os
    import subprocess
    import sys

    from test_ds_scripts import SCRIPT
    from zeroshard.tools.testing import free_port
    proc = subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "run", "--as-deepspeed", "--num_gpus", "2",
                           "--master_port", str(free_port()), str(SCRIPT), "--import-deepspeed", "--deepspeed",
                           "--deepspeed_config", str(config), "--out", str(out), "--steps", "3"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return list(json.loads(out.read_text())["losses"])


@pytest.mark.slow
def test_muon_at_world_3_and_under_zeroshard_run_as_deepspeed(tmp_path: Any) -> None:
    """Three ranks: chunks cut each matrix in three places and ownership is two matrices on three ranks;
    a checkpoint saved at world 2 (stage 3) loads at world 3 (stage 1), Adafactor's saved at world 2
    (stage 2) at world 3 (stage 3), and one saved at stage 3 at stage 0.  A script that says ``import deepspeed`` (zero.Init, GatheredParameters(modifier_rank=0),
    a WarmupLR schedule) with DeepSpeed's Muon config at stage 3, run by ``zeroshard run
    --as-deepspeed``, gives the losses of zeroshard's own API on the same model and data."""
    import json

    from test_ds_scripts import ds_config
    config = {**ds_config(3), "optimizer": {"type": "Muon", "params": {"lr": 1e-2, "adam_lr": 1e-2,
                                                                       "weight_decay": 0.01}}}
    config_path = tmp_path / "ds.json"
    config_path.write_text(json.dumps(config))
    saved = [("resume", {"save_stage": 3, "load_stage": 1, "path": str(tmp_path / "a"), "phase": "save"}),
             ("resume", {"save_stage": 2, "load_stage": 3, "path": str(tmp_path / "f"), "phase": "save",
                         "client": "adafactor"}),
             ("script_native", {"config": str(config_path), "out": str(tmp_path / "native.json")})]
    check_family(saved, run_family(2, saved, WORKERS), CHECKS, world=2)
    native = json.loads((tmp_path / "native.json").read_text())["losses"]
    losses = run_script_as_deepspeed(config_path, tmp_path / "out.json")
    assert losses == native and losses[-1] < losses[0], (losses, native)
    cases = [("train", {"stage": stage, "ns": ns}) for stage in (0, 1, 2, 3) for ns in ("fp32", "bf16")]
    cases += [("resume", {**saved[0][1], "phase": "load", "worlds": (2, 2, 3)}),
              ("resume", {**saved[1][1], "phase": "load", "worlds": (2, 2, 3)}),
              ("resume", {"save_stage": 3, "load_stage": 0, "path": str(tmp_path / "b")})]
    check_family(cases, run_family(3, cases, WORKERS), CHECKS, world=3)


WORKERS = {"train": train, "refused": refused, "resume": resume, "script_native": script_native,
           "experts": experts}
CHECKS = {"train": check_train, "refused": check_refused, "resume": check_resume, "experts": check_experts,
          "script_native": lambda by_rank, **_: None}
