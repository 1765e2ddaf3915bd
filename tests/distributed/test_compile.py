"""torch.compile with zeroshard trains exactly like eager: every stage, every way in.

One world of two runs the family: a small MLP of three layers compiled whole before ``initialize()``
(``torch.compile(model)``), through the engine (``engine.compile()``, DeepSpeed's method, which
Accelerate calls; stages 1 and 2 only this way) or (stage 3) layer by layer, three SGD steps on each
rank's own batches, against the same model trained eager in the same rank (fp32, 1e-5 relative); at
stage 3 with no parameter kept whole, so that every unit is gathered and released around its compiled
forward ([Note: stage-3 hooks run outside compiled regions] in sharding/stage3/gather_scheduler.py).
The backend is ``aot_eager`` (traced through autograd, no C++ compile);
``engine.compile(backend="inductor", compile_kwargs={})`` is accepted as Accelerate calls it, each
option that cannot work is refused by name, and dynamo warns of nothing in zeroshard it cannot trace.
Compiled equals eager also with gradient accumulation (stage 2 through the engine), each layer
checkpointed (stage 3 layer by layer), bf16 (stage 3, 1e-2) and the parameters and optimizer offloaded to
the CPU (stage 3 whole); an engine whose forward communicates
(sequence parallelism here) is refused by name.
After a warm-up of two optimizer steps (two micro-steps each) and an eval forward, ten more micro-steps
across five accumulation boundaries, a checkpoint save and another eval forward compile no new frame
(stages 0 and 3); the warm-up compiled one graph per forward at stage 0 and one per layer at stage 3,
with no graph break.  A world of one runs the stage-3 case
again: there no agreement rounds break the graph, and the hooks must stay outside it on their own.
Inductor trains a stage-3 engine through Accelerate's dynamo path in test_hf_trainer.py (extended).
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroshard
from zeroshard.checkpointing import checkpoint_modules
from zeroshard.engine.compile import CompileError
from zeroshard.tools.testing import check_family, run_family, run_world

WORLD, STEPS, WIDTH, LR = 2, 3, 16, 0.1


class Dense(nn.Module):
    """A layer whose forward is the test's own code: dynamo traces it wherever torch is installed (a
    torch module's forward may be skipped when torch's files are reached through a link)."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(outputs, inputs) / inputs ** 0.5)
        self.bias = nn.Parameter(torch.randn(outputs) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.weight, self.bias))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Dense(WIDTH, 2 * WIDTH), Dense(2 * WIDTH, WIDTH), Dense(WIDTH, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def config(stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter gathered and released
    return {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}}


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


EXTRAS = {"": {}, "accumulation": {"gradient_accumulation_steps": 2}, "checkpointing": {},
          "bf16": {"bf16": {"enabled": True}},
          "offload": {"zero_optimization": {"offload_param": {"device": "cpu"},
                                            "offload_optimizer": {"device": "cpu"}}}}
TOLERANCE = {"bf16": 1e-2}  # compiled bf16 may fuse and round otherwise than eager; fp32 is 1e-5


def trained(rank: int, stage: int, how: str, backend: str, extra: str = "",
            steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The full weights after ``steps`` optimizer steps; ``how``: "eager", "whole" (torch.compile before
    initialize), "blocks" (each layer compiled before initialize) or "engine" (engine.compile); ``extra``:
    one of ``EXTRAS`` (gradient accumulation over two micro-steps, each layer checkpointed, bf16, parameters
    and optimizer offloaded to the CPU)."""
    torch._dynamo.reset()  # each case compiles afresh: no cache limit reached by earlier cases' frames
    model = build()
    if extra == "checkpointing":
        checkpoint_modules(model, Dense)
    if how == "whole":
        model = torch.compile(model, backend=backend)
    if how == "blocks":
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, backend=backend)
    settings = config(stage)
    for key, value in EXTRAS[extra].items():  # blocks merged into the base config's
        settings[key] = {**settings[key], **value} if key in settings else value
    engine, _, _, _ = zeroshard.initialize(model=model, config=settings)
    if how == "engine":
        engine.compile(backend=backend)
        assert engine.is_compiled
    for step in range(steps * engine.gradient_accumulation_steps()):
        engine.backward(engine(batch(step, rank)).square().mean())
        engine.step()
    whole = engine.full_state_dict(rank0_only=False)
    weights = {name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): value.float()
               for name, value in whole.items()}
    engine.close()
    return weights


def worst_difference(rank: int, stage: int, how: str, backend: str = "aot_eager", extra: str = "") -> float:
    expected = trained(rank, stage, "eager", backend, extra)
    got = trained(rank, stage, how, backend, extra)
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    return max(float((got[n] - v).abs().max()) / (float(v.abs().max()) or 1.0) for n, v in expected.items())


def train(rank: int, world: int, stage: int, how: str, backend: str = "aot_eager",
          extra: str = "") -> tuple[float, list[str]]:
    """The worst relative difference, and what dynamo warned of tracing zeroshard's code."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worst = worst_difference(rank, stage, how, backend, extra)
    return worst, [str(w.message) for w in caught if "Dynamo does not know how to trace" in str(w.message)]


def check_train(results: list[tuple[float, list[str]]], extra: str = "", **_: Any) -> None:
    for rank, (worst, untraceable) in enumerate(results):
        assert worst <= TOLERANCE.get(extra, 1e-5), f"rank {rank}: compiled weights off by {worst:.2e} relative"
        assert not untraceable, f"rank {rank}: {untraceable[0]}"


def accepted(rank: int, world: int) -> bool:
    """Accelerate's call: inductor, compile_kwargs={} (nothing runs: no C++ compile here)."""
    engine, _, _, _ = zeroshard.initialize(model=build(), config=config(0))
    engine.compile(backend="inductor", compile_kwargs={})
    compiled = engine.is_compiled
    engine.close()
    return compiled


def check_accepted(results: list[bool]) -> None:
    assert all(results), "engine.compile(backend='inductor', compile_kwargs={}) did not compile"


REFUSED = {"schedule": (3, {"schedule": [(0, ["prefetch"])]}, {}),
           "fullgraph": (3, {"compile_kwargs": {"fullgraph": True}}, {}),
           "cudagraphs": (3, {"compile_kwargs": {"mode": "reduce-overhead"}}, {}),
           "backend": (0, {"backend": "no_such_backend"}, {}),
           # a forward that communicates (its collectives are not kept out of the graphs yet)
           "sequence": (1, {}, {"sequence_parallel_size": 2})}


def refused(rank: int, world: int, what: str) -> str:
    stage, arguments, extra = REFUSED[what]
    engine, _, _, _ = zeroshard.initialize(model=build(), config={**config(stage), **extra})
    try:
        engine.compile(**arguments)
        return "accepted"
    except CompileError as error:
        assert not engine.is_compiled
        return str(error)
    finally:
        engine.close()


def check_refused(results: list[str], what: str) -> None:
    named = {"schedule": "schedule=", "fullgraph": "'fullgraph': True", "cudagraphs": "'reduce-overhead'",
             "backend": "'no_such_backend'", "sequence": "with sequence parallelism is not supported yet"}[what]
    for result in results:
        assert named in result, result


def steady(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Frames compiled in the warm-up (two optimizer steps of two micro-steps each, and an eval forward),
    and in ten more micro-steps that cross five accumulation boundaries, save a checkpoint and run
    another eval forward; the graph breaks dynamo counted in the warm-up."""
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounter()
    engine, _, _, _ = zeroshard.initialize(model=build(), config={**config(stage), "gradient_accumulation_steps": 2})
    engine.compile(backend=counter)
    where = [tempfile.mkdtemp(prefix="zeroshard-compile-") if rank == 0 else ""]
    dist.broadcast_object_list(where, src=0)

    def evaluate(step: int) -> None:
        engine.eval()
        with torch.no_grad():
            engine(batch(step, rank))
        engine.train()

    for step in range(4):
        engine.backward(engine(batch(step, rank)).square().mean())
        engine.step()
    evaluate(0)
    warm, breaks = counter.frame_count, dict(counters["graph_break"])
    for step in range(4, 14):
        engine.backward(engine(batch(step, rank)).square().mean())
        engine.step()
        if step == 7:
            engine.save_checkpoint(where[0])
        if step == 9:
            evaluate(step)
    after = counter.frame_count
    engine.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(where[0], ignore_errors=True)
    return {"warm": warm, "after": after, "breaks": breaks}


def check_steady(results: list[dict[str, Any]], stage: int) -> None:
    for rank, result in enumerate(results):
        assert result["warm"] > 0, f"rank {rank}: nothing was compiled"
        assert result["after"] == result["warm"], \
            f"rank {rank}: {result['after'] - result['warm']} frames compiled after the warm-up"
        # docs/USAGE.md: the whole forward is one graph at stages 0-2, one graph per unit at stage 3 (the
        # calling frame runs eager, so dynamo counts no break); the training and the eval forward each
        # compile their own (dynamo guards on grad mode)
        assert result["warm"] == 2 * GRAPHS_PER_FORWARD[stage], f"rank {rank}, stage {stage}: {result}"
        assert not result["breaks"], f"rank {rank}, stage {stage}: graph breaks {result['breaks']}"


CASES = [*(("train", {"stage": stage, "how": how}) for stage in (0, 3) for how in ("whole", "engine")),
         *(("train", {"stage": stage, "how": "engine"}) for stage in (1, 2)),
         ("train", {"stage": 3, "how": "blocks"}),
         ("train", {"stage": 2, "how": "engine", "extra": "accumulation"}),
         ("train", {"stage": 3, "how": "blocks", "extra": "checkpointing"}),
         ("train", {"stage": 3, "how": "engine", "extra": "bf16"}),
         ("train", {"stage": 3, "how": "whole", "extra": "offload"}),
         ("accepted", {}),
         *(("refused", {"what": what}) for what in REFUSED),
         *(("steady", {"stage": stage}) for stage in (0, 3))]
GRAPHS_PER_FORWARD = {0: 1, 3: len(build().layers)}
WORKERS = {"train": train, "accepted": accepted, "refused": refused, "steady": steady}
CHECKS = {"train": check_train, "accepted": check_accepted, "refused": check_refused, "steady": check_steady}


def test_compiled_training_equals_eager() -> None:
    check_family(CASES, run_family(WORLD, CASES, WORKERS), CHECKS, WORLD)


def alone(rank: int, world: int, backend: str) -> tuple[float, list[str]]:
    return train(rank, world, 3, "whole", backend)


def test_stage3_compiled_in_a_world_of_one() -> None:
    check_train(run_world(alone, 1, args=("aot_eager",)))

