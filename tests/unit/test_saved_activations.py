"""``engine.measure_activations()``: the bytes a forward leaves saved for backward, to the byte, in a world
of one ([Note: what the measured activations count] in zeroshard/engine/saved_activations.py)."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.checkpointing import checkpoint_modules
from zeroshard.config import ConfigError
from zeroshard.engine.saved_activations import MeasureActivationsError, held_bytes

ROWS, IN, HIDDEN, OUT = 5, 4, 3, 2
FP32 = 4


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


class Block(nn.Module):
    """Linear, ReLU, Linear: the first Linear saves its input (its weight's gradient needs it; the input
    needs none), ReLU its output, which the second Linear saves again as its input, with its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> Any:
        seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
        return self.second(torch.relu(self.first(x)))


seen: list[bool] = []  # whether saved-tensor hooks were installed while each forward ran


def engine_of(stage: int, checkpointed: bool = False) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(Block())
    if checkpointed:
        checkpoint_modules(model, Block)
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    return zeroshard.initialize(model=model, config={
        "train_batch_size": ROWS, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": zero})[0]


def step(engine: Any) -> None:
    engine.backward(engine(torch.randn(ROWS, IN)).square().mean())
    engine.step()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_measured_forward_counts_its_saved_activations_to_the_byte(stage: int) -> None:
    """The input (5 x 4) and the ReLU's output (5 x 3, saved twice, counted once); no weight, whether a
    view of the engine's flat buffer (stage 0) or gathered for the forward (stage 3)."""
    engine = engine_of(stage)
    seen.clear()
    step(engine)
    assert "activations" not in engine.memory_breakdown() and seen == [False]  # off: no entry, no hooks
    with engine.measure_activations():
        step(engine)
    assert seen == [False, True]
    assert engine.memory_breakdown()["activations"] == (ROWS * IN + ROWS * HIDDEN) * FP32
    step(engine)  # outside the block: unmeasured, the last measured figure stays
    assert seen[-1] is False and engine.memory_breakdown()["activations"] == (ROWS * IN + ROWS * HIDDEN) * FP32
    engine.close()


def test_a_checkpointed_block_holds_only_its_input() -> None:
    """Activation checkpointing: the region's saves are the checkpoint's (recomputed in backward); what the
    forward holds is the block's input."""
    engine = engine_of(0, checkpointed=True)
    with engine.measure_activations():
        step(engine)
    assert engine.memory_breakdown()["activations"] == ROWS * IN * FP32
    engine.close()


def test_measure_activations_is_refused_on_a_compiled_engine_and_the_config_key_names_it() -> None:
    engine = engine_of(0)
    engine.compile(backend="eager")
    with pytest.raises(MeasureActivationsError, match="compiled engine"):
        with engine.measure_activations():
            pass
    engine.close()
    with pytest.raises(ConfigError, match=r"'memory_breakdown' = true .*measure_activations\(\)"):
        zeroshard.initialize(model=Block(), config={"train_batch_size": 1, "memory_breakdown": True,
                                                    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})


def test_a_wrapper_subclass_counts_its_inner_tensors() -> None:
    """A tensor subclass that wraps others (DTensor, FP8 tensors) has no storage of its own: its inner
    tensors' storages are counted, each once."""
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.randn(ROWS, IN), torch.randn(ROWS, IN)
    wrapped = TwoTensor(a, b)
    assert held_bytes([weakref.ref(wrapped), weakref.ref(a)], excluded=set()) == 2 * ROWS * IN * FP32
