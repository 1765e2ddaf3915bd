"""An engine's lifetime: close() hands back a plain model (no hook left) that initialize() can wrap
again; a model wrapped twice is refused by name; two engines keep their own checkpointing settings."""

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.tools.demo.model import GPT, GPTConfig
from zeroshard.engine.engine import ModelAlreadyWrappedError
from zeroshard.sharding.stage3.placeholder import ShardedParameterPlaceholder
from zeroshard.tools.testing import run_world

CFG = GPTConfig(vocab_size=50, seq_len=8, d_model=16, n_layer=2, n_head=2, attn_bias=False)
LR = 1e-3


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


def batch(step: int, rows: int = 4):
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def config(stage: int, micro: int = 4, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}


def no_zeroshard_hooks(model: nn.Module) -> list[str]:
    """Every hook or foreign object left on the model (empty when it is plain again)."""
    left = []
    for name, module in model.named_modules():
        if module._forward_pre_hooks or module._forward_hooks or module._backward_hooks:
            left.append(f"module hooks on {name or '<root>'}")
    for name, p in model.named_parameters():
        if isinstance(p, ShardedParameterPlaceholder) or type(p) is not nn.Parameter:
            left.append(f"{name} is a {type(p).__name__}")
        if getattr(p, "_post_accumulate_grad_hooks", None):
            left.append(f"grad hook on {name}")
    return left


def train(engine, steps: range, rows: int, rank: int = 0, world: int = 1) -> None:
    for step in steps:
        x, y = batch(step, rows * world)
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        engine.backward(engine(x, y))
        engine.step()


def reference(steps_before: int, steps_after: int, rows: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: AdamW for ``steps_before`` steps, then a fresh AdamW (a new engine's) for the rest."""
    torch.manual_seed(0)
    model = GPT(CFG)
    for steps in (range(steps_before), range(steps_before, steps_before + steps_after)):
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        for step in steps:
            model(*batch(step, rows)).backward()
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def lifecycle_worker(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    engine, *_ = zeroshard.initialize(model=model, config=config(stage, micro=4 // world))
    train(engine, range(2), 4 // world, rank, world)
    with pytest.raises(ModelAlreadyWrappedError, match="engine.close"):
        zeroshard.initialize(model=model, config=config(stage, micro=4 // world))
    expected = engine.full_state_dict(rank0_only=False)
    engine.close()
    engine.close()  # idempotent
    left = no_zeroshard_hooks(model)
    handed_back = all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    again, *_ = zeroshard.initialize(model=model, config=config(stage, micro=4 // world))
    train(again, range(2, 4), 4 // world, rank, world)
    return {"left": left, "handed_back": handed_back, "final": again.full_state_dict(rank0_only=False)}


@pytest.mark.parametrize("stage", [0, 3])
def test_close_hands_back_a_plain_model_that_can_be_wrapped_again(stage: int) -> None:
    result = lifecycle_worker(0, 1, stage)
    assert result["left"] == [] and result["handed_back"]
    want = reference(2, 2, 4)
    for name, value in result["final"].items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_close_at_stage3_world_2_gathers_the_weights_back() -> None:
    want = reference(2, 2, 4)
    for result in run_world(lifecycle_worker, 2, args=(3,)):
        assert result["left"] == [] and result["handed_back"]
        for name, value in result["final"].items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_two_engines_keep_their_own_checkpointing_settings() -> None:
    """Engine A profiles its checkpointed regions, engine B does not: neither sees the other's."""
    engines = []
    for profile in (True, False):
        torch.manual_seed(0)
        model = GPT(CFG)
        zeroshard.checkpointing.checkpoint_modules(model, type(model.blocks[0]))
        engine, *_ = zeroshard.initialize(model=model, config=config(
            0, activation_checkpointing={"profile": profile, "synchronize_checkpoint_boundary": not profile}))
        engines.append(engine)
    for _ in range(2):  # interleaved, as two engines in one process would be used
        for engine in engines:
            train(engine, range(1), 4)
    a, b = (e.metrics_record() for e in engines)
    assert a["checkpoint_regions"] == 2 * CFG.n_layer and a["checkpoint_recomputations"] == 2 * CFG.n_layer
    assert "checkpoint_regions" not in b
    assert engines[0].checkpointing.settings.profile and not engines[1].checkpointing.settings.profile
    assert zeroshard.checkpointing.take_profile().regions == 0  # nothing leaked into the process-wide totals
