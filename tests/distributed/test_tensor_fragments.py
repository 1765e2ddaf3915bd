"""DeepSpeed's tensor-fragment functions (``deepspeed.utils.safe_get_full_fp32_param``, ...) read and
write what training really uses, at every stage, in fp32 and bf16, with and without optimizer offload.

One world of two runs every case in turn (``run_family``).  Each case trains a small model (buckets
small enough that parameters straddle the ranks' chunks; at stage 3 its biases persistent, a frozen
layer sharded) and, beside it, the same model under plain PyTorch AdamW on the global batch.  At each
step it reads and changes gradients in the window between backward and step, fp32 values and
optimizer state after the step, by the full and the local functions, and makes the same changes to
the reference.  fp32 cases must match the reference (1e-5 relative); every case must read back
exactly what it wrote, see the parameter the model computes with follow a written fp32 value, tile
each full tensor with the ranks' local fragments, get Adam's first moments from the gradient it
set, and give None outside the gradient window and for frozen parameters.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                             safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                             safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state,
                             safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state)
from zeroshard.tools.testing import Case, check_family, run_family

LR, WD, BETAS, ROWS, CLIP = 1e-2, 0.01, (0.9, 0.999), 4, 0.05
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Net(nn.Module):
    """Blocks (stage-3 units), 10-element biases (persistent at stage 3), and a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.blocks = nn.ModuleList(nn.Linear(10, 10) for _ in range(2))
        self.frozen = nn.Linear(10, 10).requires_grad_(False)
        self.out = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return nn.functional.mse_loss(self.out(self.frozen(h)), y)


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max()) / max(float(b.float().abs().max()), 1e-12)


def tiled(local: torch.Tensor, full: torch.Tensor, stage: int) -> bool:
    """Whether the ranks' local fragments, in rank order, are the full tensor (stage 0: each is all of it)."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local.cpu())
    flat = full.cpu().reshape(-1)
    if stage == 0:
        return all(torch.equal(p, flat) for p in parts)
    return torch.equal(torch.cat(parts), flat)


class Case_:
    """One case's engine and reference, and what it found (``found``: name -> error or flag)."""

    def __init__(self, rank: int, world: int, stage: int, precision: str, zero: dict[str, Any], accum: int) -> None:
        torch.manual_seed(0)
        model = Net()
        self.reference = copy.deepcopy(model)
        self.rank, self.world, self.stage, self.accum = rank, world, stage, accum
        self.dtype = DTYPES[precision]
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": accum, "steps_per_print": 1000,
            "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "betas": list(BETAS)}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 10,
                                  **zero},
            "collective_timeout": 60}
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        self.engine, _, _, _ = zeroshard.initialize(model=model, config=config)
        self.model = model
        self.ref_opt = torch.optim.AdamW([p for p in self.reference.parameters() if p.requires_grad], lr=LR,
                                         weight_decay=WD, betas=BETAS)
        self.refs = dict(self.reference.named_parameters())
        self.trainable = [n for n, p in self.refs.items() if p.requires_grad]
        self.found: dict[str, Any] = {}

    def param(self, name: str) -> torch.Tensor:
        """The parameter as the model holds it now (at stage 3 outside forward: its placeholder)."""
        return dict(self.model.named_parameters())[name]

    def note(self, key: str, value: Any) -> None:
        """Keep the worst error (a float) or whether a property held every time (a bool)."""
        if isinstance(value, bool):
            self.found[key] = self.found.get(key, True) and value
        else:
            self.found[key] = max(self.found.get(key, 0.0), value)

    def backward(self, step: int) -> None:
        """Every micro step of ``step`` on the engine and on the reference (the global batch); checks that
        no gradient is readable before a boundary."""
        for micro in range(self.accum):
            if micro == 0:
                self.note("no_grad_before_backward", all(safe_get_full_grad(self.param(n)) is None
                                                         for n in self.trainable))
            self.engine.backward(self.engine(*batch(step, micro, self.rank)))
            if micro < self.accum - 1:
                self.note("no_grad_inside_accumulation", safe_get_local_grad(self.param("out.weight")) is None)
                self.engine.step()
            loss = sum(self.reference(*batch(step, micro, r)) for r in range(self.world))
            (loss / (self.world * self.accum)).backward()

    def step(self) -> None:
        self.engine.step()
        torch.nn.utils.clip_grad_norm_([self.refs[n] for n in self.trainable], CLIP)
        self.ref_opt.step()
        self.ref_opt.zero_grad()
        self.note("no_grad_after_step", safe_get_full_grad(self.param("inp.weight")) is None)

    def check_values(self) -> None:
        """fp32 values against the reference (fp32 runs), against the model's parameters (all runs)."""
        computed = self.engine.full_state_dict(rank0_only=False)
        for name in self.trainable:
            full = safe_get_full_fp32_param(self.param(name))
            assert full is not None and full.shape == self.refs[name].shape
            self.note("fp32_vs_reference", rel(full, self.refs[name].detach()))
            self.note("parameter_is_rounded_fp32", torch.equal(full.to(self.dtype).cpu(), computed[name]))
            self.note("local_fp32_tiles_full", tiled(self.local_or_fail(safe_get_local_fp32_param, name), full,
                                                     self.stage))
            for key in ("exp_avg", "exp_avg_sq"):
                state = safe_get_full_optimizer_state(self.param(name), key)
                assert state is not None
                self.note("state_vs_reference", rel(state, self.ref_opt.state[self.refs[name]][key]))
                local = safe_get_local_optimizer_state(self.param(name), key)
                assert local is not None
                self.note("local_state_tiles_full", tiled(local, state, self.stage))

    def local_or_fail(self, getter: Any, name: str) -> torch.Tensor:
        value: Optional[torch.Tensor] = getter(self.param(name))
        assert value is not None, f"{getter.__name__}({name}) gave None"
        return value

    # ------------------------------------------------------------------ the steps
    def first_step(self) -> None:
        """Gradients: read, tiled by the locals, changed by a full and a local setter; Adam's first moments
        then follow the changed gradient."""
        self.backward(0)
        grads = {}
        for name in self.trainable:
            grad = safe_get_full_grad(self.param(name))
            assert grad is not None, f"no gradient for {name} in the window"
            grads[name] = grad
            self.note("grad_vs_reference", rel(grad, self.refs[name].grad))
            self.note("local_grad_tiles_full", tiled(self.local_or_fail(safe_get_local_grad, name), grad, self.stage))
        safe_set_full_grad(self.param("inp.weight"), grads["inp.weight"] * 0.5)
        self.refs["inp.weight"].grad.mul_(0.5)
        local = self.local_or_fail(safe_get_local_grad, "blocks.1.weight")
        safe_set_local_grad(self.param("blocks.1.weight"), local * 2)
        self.refs["blocks.1.weight"].grad.mul_(2)
        set_grads = {"inp.weight": grads["inp.weight"] * 0.5, "blocks.1.weight": grads["blocks.1.weight"] * 2}
        for name, expected in set_grads.items():
            self.note("grad_reads_back", torch.equal(safe_get_full_grad(self.param(name)), expected))
        # the step clips by the norm of the gradients as set (the device's, and the host's copy under offload)
        norm = float(sum(float((safe_get_full_grad(self.param(n)) ** 2).sum()) for n in self.trainable)) ** 0.5
        coef = min(1.0, CLIP / (norm + 1e-6))
        self.note("clipped", coef < 1.0)
        self.step()
        for name, grad in set_grads.items():  # Adam after one step: m = (1 - beta1) g, v = (1 - beta2) g^2
            m = safe_get_full_optimizer_state(self.param(name), "exp_avg")
            v = safe_get_full_optimizer_state(self.param(name), "exp_avg_sq")
            grad = grad * coef
            self.note("first_moments_follow_set_grad", max(rel(m, (1 - BETAS[0]) * grad),
                                                           rel(v, (1 - BETAS[1]) * grad * grad)))
        self.check_values()

    def second_step(self) -> None:
        """fp32 values and optimizer state: set by full and local setters, read back, and trained on."""
        value = safe_get_full_fp32_param(self.param("inp.weight"))
        assert value is not None
        value = value * 0.5 + 0.01
        safe_set_full_fp32_param(self.param("inp.weight"), value)
        self.refs["inp.weight"].data.copy_(value)
        before = safe_get_full_fp32_param(self.param("blocks.0.weight"))
        local = self.local_or_fail(safe_get_local_fp32_param, "blocks.0.weight")
        safe_set_local_fp32_param(self.param("blocks.0.weight"), local * 1.5)
        self.refs["blocks.0.weight"].data.mul_(1.5)
        bias = safe_get_full_fp32_param(self.param("out.bias"))  # persistent at stage 3
        safe_set_full_fp32_param(self.param("out.bias"), bias - 0.25)
        self.refs["out.bias"].data.sub_(0.25)
        computed = self.engine.full_state_dict(rank0_only=False)
        for name, expected in (("inp.weight", value), ("blocks.0.weight", before * 1.5), ("out.bias", bias - 0.25)):
            self.note("fp32_reads_back", torch.equal(safe_get_full_fp32_param(self.param(name)), expected))
            self.note("model_follows_set_fp32", torch.equal(computed[name], expected.to(self.dtype).cpu()))
        m = safe_get_full_optimizer_state(self.param("blocks.1.weight"), "exp_avg")
        safe_set_full_optimizer_state(self.param("blocks.1.weight"), torch.zeros_like(m), "exp_avg")
        self.ref_opt.state[self.refs["blocks.1.weight"]]["exp_avg"].zero_()
        v = self.local_or_fail(lambda p: safe_get_local_optimizer_state(p, "exp_avg_sq"), "out.weight")
        safe_set_local_optimizer_state(self.param("out.weight"), v * 2, "exp_avg_sq")
        self.ref_opt.state[self.refs["out.weight"]]["exp_avg_sq"].mul_(2)
        self.note("state_reads_back", torch.equal(
            safe_get_full_optimizer_state(self.param("blocks.1.weight"), "exp_avg"), torch.zeros_like(m)))
        self.note("state_reads_back", torch.equal(
            safe_get_local_optimizer_state(self.param("out.weight"), "exp_avg_sq"), v * 2))
        self.backward(1)
        self.step()
        self.check_values()

    def frozen(self) -> None:
        weight = self.param("frozen.weight")
        self.note("frozen_gives_none", safe_get_full_fp32_param(weight) is None and
                  safe_get_local_fp32_param(weight) is None and safe_get_full_grad(weight) is None)


def fragments_worker(rank: int, world: int, directory: str, stage: int, precision: str,
                     zero: dict[str, Any], accum: int = 1) -> dict[str, Any]:
    zero = {k: ({**v, "nvme_path": directory} if isinstance(v, dict) and v.get("device") == "nvme" else v)
            for k, v in zero.items()}
    run = Case_(rank, world, stage, precision, zero, accum)
    run.first_step()
    run.second_step()
    run.frozen()
    run.engine.close()
    return run.found


#: what every case must find (flags) and the errors allowed (fp32 runs against the reference only)
FLAGS = ("no_grad_before_backward", "clipped", "no_grad_after_step", "parameter_is_rounded_fp32", "local_fp32_tiles_full",
         "local_state_tiles_full", "local_grad_tiles_full", "grad_reads_back", "fp32_reads_back",
         "model_follows_set_fp32", "state_reads_back", "frozen_gives_none")
REFERENCE_ERRORS = ("fp32_vs_reference", "state_vs_reference", "grad_vs_reference")


def check_fragments(results: list[dict[str, Any]], directory: Any, stage: int, precision: str,
                    zero: dict[str, Any], accum: int = 1) -> None:
    for rank, found in enumerate(results):
        failed = [flag for flag in FLAGS if found.get(flag) is not True]
        if accum > 1 and found.get("no_grad_inside_accumulation") is not True:
            failed.append("no_grad_inside_accumulation")
        assert not failed, f"rank {rank}: {failed}"
        assert found["first_moments_follow_set_grad"] <= 1e-5, f"rank {rank}: {found}"
        if precision == "fp32":
            worst = {k: found[k] for k in REFERENCE_ERRORS if found[k] > 1e-5}
            assert not worst, f"rank {rank}: off the reference by {worst}"


CPU = {"device": "cpu"}
CASES: list[Case] = [("fragments", {"stage": s, "precision": p, "zero": {}}) for s in (0, 1, 2, 3)
                     for p in ("fp32", "bf16")]
CASES += [("fragments", {"stage": 2, "precision": "fp32", "zero": {"offload_optimizer": CPU}}),
          ("fragments", {"stage": 3, "precision": "bf16", "zero": {"offload_optimizer": CPU, "offload_param": CPU}})]
NVME = {"device": "nvme"}
EXTENDED: list[Case] = [
    ("fragments", {"stage": 1, "precision": "bf16", "zero": {}, "accum": 2}),
    ("fragments", {"stage": 3, "precision": "fp32", "zero": {"offload_optimizer": CPU}, "accum": 2}),
    ("fragments", {"stage": 3, "precision": "bf16", "zero": {"offload_optimizer": NVME}}),
    ("fragments", {"stage": 2, "precision": "bf16", "zero": {"offload_optimizer": NVME}, "accum": 2}),
]
WORKERS = {"fragments": fragments_worker}
CHECKS = {"fragments": check_fragments}


def test_tensor_fragment_functions_read_and_write_what_training_uses(tmp_path: Any) -> None:
    check_family(CASES, run_family(2, CASES, WORKERS, root=tmp_path), CHECKS, world=2, root=tmp_path)


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_tensor_fragment_functions_with_accumulation_and_nvme_offload(tmp_path: Any) -> None:
    check_family(EXTENDED, run_family(2, EXTENDED, WORKERS, root=tmp_path), CHECKS, world=2, root=tmp_path)
