"""The engine is composed of parts chosen from the axes (engine/parts.py): no variant overrides a private
hook of the engine, the core engine imports nothing of zeroshard/deepspeed, and the norm parts compose."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from zeroshard.engine.engine import Engine
from zeroshard.engine.parts import JobNorm, ShardNorm
from zeroshard.optim.clipping import global_grad_norm
from zeroshard.pipeline import PipelineEngine
from zeroshard.pipeline.norm import StagesNorm

ROOT = Path(__file__).resolve().parents[2]


def test_no_engine_variant_overrides_a_private_hook() -> None:
    """A pipeline stage's engine differs by its parts, not by overriding the engine's private methods."""
    private = {name for name in vars(Engine) if name.startswith("_") and not name.startswith("__")}
    overridden = sorted(private & set(vars(PipelineEngine)))
    assert not overridden, f"PipelineEngine overrides Engine's private {overridden}"


def test_the_engine_imports_nothing_of_the_deepspeed_face() -> None:
    """DeepSpeed's accessors are registered on the engine from zeroshard/deepspeed, never imported by it."""
    offending = []
    for path in sorted((ROOT / "zeroshard" / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and "deepspeed" in node.module.split("."):
                offending.append(f"{path.name}: from {'.' * node.level}{node.module}")
    assert not offending, offending


def test_the_engine_answers_deepspeed_names_through_the_registered_facade() -> None:
    import zeroshard
    from zeroshard.deepspeed.engine_api import DeepSpeedEngineAPI
    from zeroshard.engine import parts

    assert zeroshard.__name__ == "zeroshard"
    assert parts._EXTRA_NAMES == [DeepSpeedEngineAPI]


def test_norm_parts_compose() -> None:
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]
    plain = ShardNorm(torch.device("cpu"))
    assert float(plain(grads, None)) == float(global_grad_norm(grads, None)) == 5.0
    one_stage = JobNorm(plain, StagesNorm(pipe=None, num_stages=1))  # type: ignore[arg-type]
    assert float(one_stage(grads, None)) == 5.0
    doubled = JobNorm(plain, lambda norm: norm * 2)
    assert float(doubled(grads, None)) == 10.0
