"""World size 1 without torchrun or a process group; the initialize() API surface; schedules; layout."""

import math
import os

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.tools.demo.model import GPT, GPTConfig
from zeroshard.distributed.collectives import CommKind
from zeroshard.optim.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR
from zeroshard.sharding import plan_buckets
from zeroshard.sharding.stage3.placeholder import ShardedParameterPlaceholder

CFG = GPTConfig(vocab_size=50, seq_len=8, d_model=16, n_layer=1, n_head=2, attn_bias=False)


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_world_of_one_without_torchrun_matches_plain_adamw(stage: int) -> None:
    """Every stage in one process without a process group, stage 3 included (every parameter sharded
    into a world of one: gathered for each use, released after), trains as plain PyTorch does."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    ours = GPT(CFG)
    ours.load_state_dict(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    engine, _, _, _ = zeroshard.initialize(model=ours, config={
        "train_batch_size": 4, "gradient_clipping": 0.5, "optimizer": {"type": "AdamW",
        "params": {"lr": 1e-3, "weight_decay": 0.1}}, "zero_optimization": zero})
    assert engine.world.world_size == 1 and engine.world.group is None
    for step in range(4):
        x, y = batch(step)
        ref(x, y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        engine.backward(engine(x, y))
        engine.step()
    if stage == 3:  # released between steps: the module shows placeholders, nothing is held gathered
        assert all(isinstance(p, ShardedParameterPlaceholder) for p in ours.parameters())
        assert engine.memory_breakdown()["gathered_params"] == 0
        assert engine.comm.counters[CommKind.ALL_GATHER].calls > 0
    with zeroshard.GatheredParameters(list(ours.parameters())):
        for a, b in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert engine.comm.total_bytes_sent() == 0


def test_initialize_accepts_objects_and_callables() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    dataset = torch.utils.data.TensorDataset(torch.randint(0, 50, (12, 8)), torch.randint(0, 50, (12, 8)))
    engine, optimizer, loader, scheduler = zeroshard.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, training_data=dataset,
        config={"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2})
    assert optimizer is opt and scheduler is sched
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert loader is not None and len(loader) == 4
    assert engine.train_batch_size() == 6 and engine.train_micro_batch_size_per_gpu() == 3
    assert engine.gradient_accumulation_steps() == 2
    before = [p.detach().clone() for p in model.parameters()]
    for i, (x, y) in enumerate(loader):
        assert engine.is_gradient_accumulation_boundary() == (i % 2 == 1)
        engine.backward(engine(x, y))
        engine.step()
    assert (engine.global_steps, engine.micro_steps) == (2, 4)
    assert engine.get_lr() == [pytest.approx(1e-3 / 3)] * 2
    assert engine.get_global_grad_norm() > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert engine.module is model
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training


@pytest.mark.parametrize("drop_last", [False, True])
def test_dataloader_drop_last_as_deepspeed(drop_last: bool) -> None:
    """``dataloader_drop_last`` false (DeepSpeed's default) hands out every sample, the last micro batch
    short; true only full micro batches."""
    dataset = torch.utils.data.TensorDataset(torch.arange(10.0).unsqueeze(1), torch.zeros(10, 1))
    config = {"train_micro_batch_size_per_gpu": 3, "dataloader_drop_last": drop_last,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, _, loader, _ = zeroshard.initialize(model=nn.Linear(1, 1), config=config, training_data=dataset)
    assert engine.config.dataloader_drop_last is drop_last
    sizes = [len(x) for x, _ in loader]
    seen = sorted(int(v) for x, _ in loader for v in x.flatten())  # the next epoch: reshuffled, same sizes
    assert sizes == ([3, 3, 3] if drop_last else [3, 3, 3, 1]) and len(loader) == len(sizes)
    assert len(seen) == sum(sizes) and (len(set(seen)) == 9 if drop_last else seen == list(range(10)))
    engine.close()


def test_callable_optimizer_and_scheduler() -> None:
    model = nn.Linear(5, 3)
    engine, opt, _, sched = zeroshard.initialize(
        model=model, optimizer=lambda groups: torch.optim.SGD(groups, lr=0.5),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        config={"train_batch_size": 2})
    assert isinstance(opt, torch.optim.SGD)
    x = torch.randn(2, 5)
    engine.backward(engine(x).sum())
    engine.step()
    assert engine.get_lr() == [0.25]


@pytest.mark.parametrize("optimizer", ["config", "callable"])
def test_a_scheduler_built_before_initialize_drives_the_engines_optimizer(optimizer: str) -> None:
    """A scheduler object built on a throwaway optimizer over the model's parameters, with the engine
    building its own optimizer: the same object comes back, moved onto the engine's optimizer, and
    training follows its schedule (see [Note: a scheduler built before initialize()] in
    optim/scheduler_rebinding.py)."""
    import warnings

    model = nn.Linear(5, 3)
    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=0.4), lambda s: 0.5 ** s)
    config: dict = {"train_batch_size": 2}
    if optimizer == "config":
        config["optimizer"] = {"type": "SGD", "params": {"lr": 1.0}}
    engine, opt, _, returned = zeroshard.initialize(
        model=model, config=config, lr_scheduler=sched,
        optimizer=None if optimizer == "config" else (lambda groups: torch.optim.SGD(groups, lr=1.0)))
    assert returned is sched and sched.optimizer is opt
    assert engine.get_lr() == [pytest.approx(0.4)] and opt.param_groups[0]["initial_lr"] == 0.4
    before = model.weight.detach().clone()
    x = torch.randn(2, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "scheduler stepped before its optimizer" warnings included
        engine.backward(engine(x).sum())
        engine.step()
    assert engine.get_lr() == [pytest.approx(0.2)]
    grad = x.sum(0).expand(3, 5)  # d(sum of outputs)/d weight: the same for each output row
    torch.testing.assert_close(model.weight.detach(), before - 0.4 * grad)
    engine.close()


def test_a_scheduler_that_cannot_be_moved_is_refused() -> None:
    from zeroshard.errors import InitializeArgumentError

    model = nn.Linear(5, 3)
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 1.0}}}
    elsewhere = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1), 1)
    with pytest.raises(InitializeArgumentError, match="not the model's parameters"):
        zeroshard.initialize(model=model, config=config, lr_scheduler=elsewhere)
    model = nn.Linear(5, 3)
    two_groups = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    with pytest.raises(InitializeArgumentError, match="2 parameter groups"):
        zeroshard.initialize(model=model, config=config, lr_scheduler=torch.optim.lr_scheduler.StepLR(two_groups, 1))
    model = nn.Linear(5, 3)
    passed = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InitializeArgumentError, match="another optimizer than the one passed"):
        zeroshard.initialize(model=model, config=config, optimizer=passed,
                             lr_scheduler=torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters()), 1))


def test_initialize_without_a_model_is_an_assertion_error_too() -> None:
    """DeepSpeed asserts; zeroshard's error is a ValueError and an AssertionError (see [Note: argument
    errors that are also AssertionErrors])."""
    config = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 1.0}}}
    with pytest.raises(AssertionError, match="needs model="):
        zeroshard.initialize(model=None, config=config)
    with pytest.raises(ValueError, match="passed as the first argument"):
        zeroshard.initialize(nn.Linear(2, 2), config=config)


@pytest.mark.parametrize("stage", [0, 3])
def test_an_engine_without_an_optimizer_runs_forward_passes(stage: int) -> None:
    """[Note: an engine without an optimizer] in optim/no_optimizer.py: the same outputs as the model, and
    every call that trains refused by name."""
    from zeroshard.errors import InitializeArgumentError
    from zeroshard.optim.no_optimizer import NoOptimizerError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    expected = model(x).detach()
    engine, optimizer, _, _ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": stage}})
    with torch.no_grad():
        assert torch.equal(engine(x), expected)
    loss = engine(x).sum()
    with pytest.raises(NoOptimizerError):
        engine.backward(loss)
    with pytest.raises(NoOptimizerError):
        engine.step()
    with pytest.raises(NoOptimizerError):
        optimizer.step()
    engine.close()
    for config, why in (({"zero_optimization": {"stage": 1}}, "stage 1"),
                        ({"zero_optimization": {"stage": stage}, "scheduler": {"type": "WarmupLR"}}, "a schedule")):
        with pytest.raises(InitializeArgumentError):
            zeroshard.initialize(model=nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1, **config})


def test_zero_grad_drops_accumulated_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    start = model.weight.detach().clone()
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
    x = torch.ones(1, 4)
    engine.backward(engine(x).sum() * 100)  # thrown away below
    engine.zero_grad()
    engine.micro_steps = 0
    engine.backward(engine(x).sum())
    engine.step()
    engine.backward(engine(x).sum())
    engine.step()
    torch.testing.assert_close(model.weight.detach(), start - 1.0 * x)  # mean of two identical grads


def test_config_and_api_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="got no optimizer"):  # stage 1: the optimizer's state is what it shards
        zeroshard.initialize(model=nn.Linear(2, 2), config={"train_batch_size": 1, "zero_optimization": {"stage": 1}})
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="nothing to train"):
        zeroshard.initialize(model=frozen, config={"train_batch_size": 1, "optimizer": {"type": "SGD"}})
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="'1.weight' requires grad but is not in model_parameters"):
        zeroshard.initialize(model=m, model_parameters=list(m[0].parameters()),
                             config={"train_batch_size": 1, "optimizer": {"type": "SGD"}})


def test_checkpoint_without_a_directory_is_a_named_error(tmp_path, monkeypatch) -> None:
    """An empty directory name or None is refused before anything is written (DeepSpeed: ValueError)."""
    from zeroshard.checkpoint.format import CheckpointDirectoryError

    monkeypatch.chdir(tmp_path)
    engine, *_ = zeroshard.initialize(model=nn.Linear(2, 2), config={"train_batch_size": 1,
                                                                     "optimizer": {"type": "SGD"}})
    for bad in ("", "  ", None):
        with pytest.raises(CheckpointDirectoryError, match=r"save_checkpoint\(save_dir="):
            engine.save_checkpoint(bad)
        with pytest.raises(CheckpointDirectoryError, match=r"load_checkpoint\(load_dir="):
            engine.load_checkpoint(bad)
    assert list(tmp_path.iterdir()) == []  # nothing written into the current directory
    assert issubclass(CheckpointDirectoryError, ValueError)
    engine.close()


def test_deepspeed_schedules() -> None:
    p = [nn.Parameter(torch.zeros(1))]
    lin = WarmupLR(torch.optim.SGD(p, lr=1.0), 0.0, 1.0, warmup_num_steps=4, warmup_type="linear")
    lrs = []
    for _ in range(6):
        lrs.append(lin.get_last_lr()[0])
        lin.optimizer.step()
        lin.step()
    assert lrs == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0]  # DeepSpeed's: the schedule starts at iteration -1
    log = WarmupLR(torch.optim.SGD(p, lr=1.0), 0.0, 1.0, warmup_num_steps=10)
    for _ in range(2):
        log.optimizer.step()
        log.step()
    assert log.get_last_lr()[0] == pytest.approx(math.log(2) / math.log(10))
    decay = WarmupDecayLR(torch.optim.SGD(p, lr=1.0), total_num_steps=10, warmup_max_lr=1.0,
                          warmup_num_steps=2, warmup_type="linear")
    for _ in range(6):
        decay.optimizer.step()
        decay.step()
    assert decay.get_last_lr()[0] == pytest.approx(0.625)  # iteration 5: (10 - 5) / (10 - 2)
    cos = WarmupCosineLR(torch.optim.SGD(p, lr=2.0), total_num_steps=10, warmup_num_steps=2,
                         cos_min_ratio=0.0, warmup_type="linear")
    for _ in range(6):
        cos.optimizer.step()
        cos.step()
    # iteration 5: cosine progress (5 - 2 + 1) / (10 - 2)
    assert cos.get_last_lr()[0] == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_bucket_plan_pads_each_bucket_and_keeps_groups_apart() -> None:
    params = [torch.zeros(5), torch.zeros(7), torch.zeros(11), torch.zeros(3)]
    layout = plan_buckets(params, ["a", "b", "c", "d"], [0, 0, 1, 1], bucket_numel=10, world_size=3)
    # reverse order: d, c | (group change) b, a
    assert [[s.name for s in b.slots] for b in layout.buckets] == [["d", "c"], ["b", "a"]]
    assert [(b.numel, b.padded_numel) for b in layout.buckets] == [(14, 15), (12, 12)]
    assert [b.real_numel_in_shard(2) for b in layout.buckets] == [4, 4]
    assert sum(layout.real_numel_in_shard(r) for r in range(3)) == 26
    assert os.environ.get("WORLD_SIZE") is None


def test_metrics_every_steps_per_print_to_jsonl(tmp_path) -> None:
    import json

    torch.manual_seed(0)
    path = tmp_path / "metrics.jsonl"
    engine, _, _, _ = zeroshard.initialize(model=GPT(CFG), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 2,
        "wall_clock_breakdown": True, "metrics_path": str(path), "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW"}})
    for step in range(8):
        x, y = batch(step)
        engine.backward(engine(x[:2], y[:2]))
        engine.step()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["samples_per_s"] > 0
        assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["step_s"] > 0
        assert r["grad_norm"] > 0 and r["host_peak_mib"] > 0 and r["skipped_steps"] == 0
    assert engine.last_metrics == records[-1]


def test_tensorboard_without_the_package_is_a_clear_error(monkeypatch) -> None:
    import sys

    # as if it were not installed: an import of a module set to None raises ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="'tensorboard.enabled' is true but the tensorboard package"):
        zeroshard.initialize(model=nn.Linear(2, 2), config={
            "train_batch_size": 1, "optimizer": {"type": "SGD"}, "tensorboard": {"enabled": True}})


def test_tensorboard_gets_every_metric_record(tmp_path) -> None:
    """tensorboard.enabled: each metrics record's numbers become scalars at its step in
    output_path/job_name, with the values metrics_path's JSON lines hold."""
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (pip install tensorboard)")
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    path = tmp_path / "metrics.jsonl"
    engine, _, _, _ = zeroshard.initialize(model=GPT(CFG), config={
        "train_batch_size": 2, "steps_per_print": 1, "metrics_path": str(path), "optimizer": {"type": "AdamW"},
        "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "job"}})
    for step in range(3):
        x, y = batch(step)
        engine.backward(engine(x[:2], y[:2]))
        engine.step()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    run = tmp_path / "tb" / "job"
    assert list(run.glob("events.out.tfevents.*")), "no event file in output_path/job_name"
    events = EventAccumulator(str(run))
    events.Reload()
    numeric = {k for r in records for k, v in r.items() if isinstance(v, (int, float)) and k != "step"}
    assert set(events.Tags()["scalars"]) == numeric
    for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [1, 2, 3], key
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in records], rel=1e-6), key  # float32


def test_stage3_parameters_answer_deepspeeds_attributes() -> None:
    """DeepSpeed's ds_* attributes on what a stage-3 module shows: a released parameter's placeholder
    answers them from the storage before, during and after a gather; the gathered parameter itself is a
    plain full tensor without them; a parameter built under Init answers them too."""
    from zeroshard.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    torch.manual_seed(0)
    model = GPT(CFG)
    shapes = [p.shape for p in model.parameters()]
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    shown = list(model.parameters())
    assert all(isinstance(p, ShardedParameterPlaceholder) for p in shown)
    assert len({p.ds_id for p in shown}) == len(shown)
    for p, shape in zip(shown, shapes):
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist
        assert p.ds_shape == shape and p.ds_numel == shape.numel()
        assert p.ds_tensor.shape == (shape.numel(),)  # a world of one owns every element

    linear = next(m for m in model.modules() if isinstance(m, nn.Linear))
    placeholder = linear.weight
    seen = []

    def during_forward(module, args):
        seen.append((placeholder.ds_status, hasattr(module.weight, "ds_id"), module.weight.numel()))

    handle = linear.register_forward_pre_hook(during_forward)
    engine.backward(engine(*batch(0)))
    handle.remove()
    assert seen and seen[0] == (ZeroParamStatus.AVAILABLE, False, placeholder.ds_numel)

    with zeroshard.GatheredParameters([placeholder]):
        assert placeholder.ds_status is ZeroParamStatus.AVAILABLE
        torch.testing.assert_close(placeholder.ds_tensor, linear.weight.detach().reshape(-1))
    assert linear.weight is placeholder and placeholder.ds_status is ZeroParamStatus.NOT_AVAILABLE
    engine.close()

    with zeroshard.Init():
        built = nn.Linear(3, 5)
    assert built.weight.ds_shape == (5, 3) and built.weight.ds_numel == 15
    assert built.weight.ds_tensor.numel() == 15 and built.weight.ds_id != built.bias.ds_id
    assert built.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    with zeroshard.GatheredParameters([built.weight]):
        assert built.weight.ds_status is ZeroParamStatus.AVAILABLE
    assert not hasattr(built.weight.data, "ds_id")  # a view is not a parameter


def test_an_init_built_model_moves_between_devices_and_keeps_its_values() -> None:
    """``model.cpu()`` / ``.to(device)`` / ``.half()`` on a model built under ``zeroshard.Init`` convert each
    rank's chunk (see [Note: what an Init-built parameter does with each operation] in
    sharding/stage3/init_param.py), including writes through ``.data`` during nested constructors."""

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.ones(5))
            self.a.data = (self.a.data + 1).data

    class Child(Parent):
        def __init__(self) -> None:
            super().__init__()
            self.b = nn.Parameter(torch.arange(6.0).reshape(2, 3))
            self.a.data = (self.a.data * 3).data

    with zeroshard.Init():
        model = Child().cpu().to("cpu")
    half = model.b.half()
    with zeroshard.GatheredParameters([model.a, model.b]):
        assert model.a.tolist() == [6.0] * 5 and model.b.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert half.dtype == torch.float16 and half.shape == (2, 3)


@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_parameters_that_modify_wait_on_the_engines_copy_gate(stage: int) -> None:
    """A ``GatheredParameters`` block that writes (``modifier_rank``) first waits until the engine's
    asynchronous save has copied the state, through the gate the engine gave its storage; a block that
    only reads does not wait."""
    engine, _, _, _ = zeroshard.initialize(model=GPT(CFG), config={
        "train_batch_size": 4, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": stage}})
    assert engine.storage.copy_gate is engine.saves  # given when the engine was built

    class Gate:
        waits = 0

        def copying(self) -> bool:
            return False

        def wait_for_copies(self) -> None:
            Gate.waits += 1

    engine.storage.set_copy_gate(Gate())
    params = list(engine.module.parameters())
    with zeroshard.GatheredParameters(params):
        pass
    assert Gate.waits == 0
    with zeroshard.GatheredParameters(params, modifier_rank=0):
        pass
    assert Gate.waits == 1  # once per storage, however many buckets
    engine.close()
