"""The pipeline's pure parts (schedules, partitions, headers) and a one-stage pipeline in one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.pipe import LayerSpec, PipelineModule
from zeroshard.pipeline import GPipe, OneFOneB, PartitionMethodError, PipelineUsageError, TooFewLayersError
from zeroshard.pipeline import executor
from zeroshard.pipeline.executor import BatchTiming, StageClock
from zeroshard.pipeline.p2p import decode_header, encode_header
from zeroshard.pipeline.partition import partition
from zeroshard.pipeline.schedule import (Backward, Forward, InterleavedOneFOneB, ScheduleDeadlockError,
                                         ScheduleShapeError, timeline)


@pytest.mark.parametrize("schedule", [OneFOneB(), GPipe()])
def test_schedules_run_every_pass_once_in_micro_batch_order(schedule) -> None:
    for p in (1, 2, 4):
        for m in (1, 3, 8):
            for s in range(p):
                actions = schedule.actions(s, p, m)
                assert [a.micro_batch for a in actions if isinstance(a, Forward)] == list(range(m))
                assert [a.micro_batch for a in actions if isinstance(a, Backward)] == list(range(m))
                for i in range(m):  # a micro-batch's backward comes after its forward
                    assert actions.index(Forward(i)) < actions.index(Backward(i))


def test_interleaved_runs_every_chunk_pass_once_in_one_order_on_every_rank() -> None:
    schedule = InterleavedOneFOneB()
    for p in (2, 3, 4):
        for v in (2, 3):
            for m in (p, 2 * p, 3 * p):
                orders = []
                for s in range(p):
                    actions = schedule.actions(s, p, m, v)
                    items = {(a.micro_batch, a.chunk) for a in actions}
                    assert len(actions) == 2 * m * v and items == {(i, c) for i in range(m) for c in range(v)}
                    for i in range(m):
                        for c in range(v):
                            assert actions.index(Forward(i, c)) < actions.index(Backward(i, c))
                    assert actions[-1] == Backward(m - 1, 0)  # the batch's last backward is a first chunk's
                    orders.append(([a for a in actions if isinstance(a, Forward)],
                                   [a for a in actions if isinstance(a, Backward)]))
                assert all(order == orders[0] for order in orders)  # messages pair up in send order


def test_timeline_equals_each_schedules_bubble() -> None:
    for schedule in (OneFOneB(), GPipe(), InterleavedOneFOneB()):
        for p in (2, 4):
            for v in ((2, 3) if schedule.interleaved else (1,)):
                for m in (p, 4 * p):
                    for forward_s, backward_s in ((1.0, 2.0), (1.0, 1.0)):
                        idle = timeline(schedule, p, m, v, forward_s, backward_s)
                        assert idle == pytest.approx([schedule.bubble_fraction(p, m, v)] * p)
    assert InterleavedOneFOneB.bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    assert 3 / 19 < OneFOneB.bubble_fraction(4, 8)


def test_timeline_finds_a_deadlock_and_the_schedules_refuse_bad_shapes() -> None:
    class Backwards(OneFOneB):
        """Every backward before the forwards: no rank can start."""
        def actions(self, stage, num_stages, micro_batches, chunks=1):
            return sorted(super().actions(stage, num_stages, micro_batches, chunks), key=lambda a: isinstance(a, Forward))

    with pytest.raises(ScheduleDeadlockError):
        timeline(Backwards(), 2, 2)
    with pytest.raises(ScheduleShapeError):
        InterleavedOneFOneB().actions(0, 2, 3, 2)  # micro-batches not a multiple of the stages
    with pytest.raises(ScheduleShapeError):
        InterleavedOneFOneB().actions(0, 2, 4, 1)
    with pytest.raises(ScheduleShapeError):
        OneFOneB().actions(0, 2, 4, 2)


def test_one_f_one_b_holds_at_most_the_stages_after_it() -> None:
    p, m = 4, 8
    for s in range(p):
        live, peak = 0, 0
        for action in OneFOneB().actions(s, p, m):
            live += 1 if isinstance(action, Forward) else -1
            peak = max(peak, live)
        assert peak == p - s
    assert OneFOneB.bubble_fraction(4, 8) == pytest.approx(3 / 11)


def test_partitions() -> None:
    layers = [LayerSpec(nn.Linear, 4, 4), torch.tanh, LayerSpec(nn.Linear, 4, 8), LayerSpec(nn.Linear, 8, 2)]
    assert partition(layers, 2, "parameters") == [0, 1, 4]  # 20 | 0 + 40 + 18: ties go to the earliest cut
    assert partition(layers, 4, "uniform") == [0, 1, 2, 3, 4]
    assert partition(layers, 2, "type:linear")[0] == 0
    with pytest.raises(TooFewLayersError):
        partition(layers, 5, "uniform")
    with pytest.raises(PartitionMethodError):
        partition(layers, 2, "best")


def test_header_round_trip() -> None:
    values = (torch.zeros(2, 3, requires_grad=True), torch.ones(5, dtype=torch.int64))
    assert decode_header(encode_header(values)) == [(torch.float32, True, (2, 3)), (torch.int64, False, (5,))]


def test_one_stage_pipeline_trains_in_one_process() -> None:
    torch.manual_seed(0)
    module = PipelineModule([LayerSpec(nn.Linear, 4, 4), torch.tanh, LayerSpec(nn.Linear, 4, 1)], num_stages=1,
                            loss_fn=nn.functional.mse_loss)
    engine, _, _, _ = zeroshard.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    batches = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(2)]
    first = float(engine.train_batch(iter(batches)))
    second = float(engine.train_batch(iter(batches)))
    assert second < first
    seen = []
    engine.set_batch_fn(lambda batch: seen.append(batch) or (batch[0], batch[1] * 0))  # DeepSpeed's batch_fn
    zero_target = float(engine.eval_batch(iter(batches)))
    assert len(seen) == 2 and zero_target == pytest.approx(
        float(sum(nn.functional.mse_loss(module(x), torch.zeros(2, 1)) for x, _ in batches)) / 2)
    with pytest.raises(PipelineUsageError):
        engine(torch.zeros(2, 4))
    engine.close()


@pytest.mark.parametrize("checkpointable, recomputed", [(None, 2), (["Linear"], 2), (["ReLU"], 1), ([], 0)])
def test_activation_checkpointing_recomputes_the_runs_it_may(checkpointable, recomputed) -> None:
    """``activation_checkpoint_interval`` 1: each layer is a run; ``checkpointable_layers`` names the classes
    that may be recomputed (without it, the runs that hold parameters)."""
    runs = []

    def counting_checkpoint(function, *args):
        runs.append(function)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    torch.manual_seed(0)
    module = PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 4, 1)],
                            num_stages=1, loss_fn=nn.functional.mse_loss, activation_checkpoint_interval=1,
                            activation_checkpoint_func=counting_checkpoint, checkpointable_layers=checkpointable)
    plain = nn.Sequential(*[layer for layer in module.layers])
    x = torch.randn(2, 4)
    out = module(x)
    assert len(runs) == recomputed
    assert torch.equal(out, plain(x))


def test_fp16_trains_and_nvme_offload_and_async_saves_are_refused(tmp_path) -> None:
    from zeroshard.pipeline import PipelineConfigError

    layers = [LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 1)]
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    nvme = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    with pytest.raises(PipelineConfigError, match="nvme"):
        zeroshard.initialize(model=PipelineModule(layers, num_stages=1, loss_fn=nn.functional.mse_loss),
                             config={**base, "zero_optimization": nvme})
    torch.manual_seed(0)
    engine, _, _, _ = zeroshard.initialize(model=PipelineModule(layers, num_stages=1, loss_fn=nn.functional.mse_loss),
                                           config={**base, "fp16": {"enabled": True, "initial_scale_power": 4}})
    batches = [(torch.randn(2, 4), torch.randn(2, 1))]
    losses = [float(engine.train_batch(iter(batches))) for _ in range(2)]
    assert engine.loss_scaler.scale == 16 and engine.skipped_steps == 0 and losses[1] < losses[0]
    with pytest.raises(PipelineUsageError, match="synchronously"):
        engine.save_checkpoint("unused", async_save=True)
    engine.close()


def test_resume_inside_initialize_in_one_process(tmp_path) -> None:
    """``checkpoint.auto_resume`` / ``initialize(resume_from=...)`` with a pipeline: no checkpoint yet, a fresh
    start; later, the latest periodic save; auto_resume without a save_dir is refused as without a pipeline
    (the multi-rank resume, loader and RNG included: tests/distributed/test_pipeline.py)."""
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    periodic = {"save_dir": str(tmp_path / "ckpt"), "save_interval": 2}

    def start(checkpoint, resume_from=None):
        torch.manual_seed(0)
        module = PipelineModule([LayerSpec(nn.Linear, 4, 4), torch.tanh, LayerSpec(nn.Linear, 4, 1)], num_stages=1,
                                loss_fn=nn.functional.mse_loss)
        return zeroshard.initialize(model=module, config={**base, "checkpoint": checkpoint},
                                    resume_from=resume_from)[0]

    with pytest.raises(ValueError, match="save_dir"):
        start({"auto_resume": True})
    batches = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(3)]
    engine = start({**periodic, "auto_resume": True})
    assert engine.global_steps == 0
    straight = [float(engine.train_batch(iter([batch]))) for batch in batches]
    engine.close()
    for checkpoint, resume_from in (({**periodic, "auto_resume": True}, None), (periodic, "latest"),
                                    ({}, tmp_path / "ckpt")):
        engine = start(checkpoint, resume_from)
        assert engine.global_steps == 2, (checkpoint, resume_from)
        assert float(engine.train_batch(iter(batches[2:]))) == straight[2]
        engine.close()
    engine = start({}, tmp_path / "empty")  # a directory without checkpoints: a fresh start
    assert engine.global_steps == 0 and float(engine.train_batch(iter(batches[:1]))) == straight[0]
    engine.close()


def test_stage3_batch_gathers_and_timing_in_one_process() -> None:
    """ZeRO-3 on one stage: gathering once per batch (the default) trains as gathering per micro-batch does,
    holds every unit pinned during the batch only, and each batch leaves its timing on the engine."""
    from zeroshard.config import load_config

    assert load_config({}).pipeline.stage3_gather_per_micro_batch is False
    batches = [(torch.randn(2, 4, generator=torch.Generator().manual_seed(i)), torch.zeros(2, 1)) for i in range(3)]
    losses = {}
    for per_micro_batch in (False, True):
        torch.manual_seed(0)
        module = PipelineModule([LayerSpec(nn.Linear, 4, 4), torch.tanh, LayerSpec(nn.Linear, 4, 1)], num_stages=1,
                                loss_fn=nn.functional.mse_loss)
        engine, _, _, _ = zeroshard.initialize(model=module, config={
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "pipeline": {"stage3_gather_per_micro_batch": per_micro_batch}})
        assert engine.last_batch_timing is None
        held = []
        module.register_forward_pre_hook(lambda m, args: held.append(engine.batch_gathers.held))
        losses[per_micro_batch] = [float(engine.train_batch(iter(batches))) for _ in range(2)]
        assert held == [not per_micro_batch] * 6 and not engine.batch_gathers.held
        assert engine.storage.gathered_bytes() == 0  # released before the step
        timing = engine.last_batch_timing
        assert timing is not None and timing.busy_s > 0  # one stage receives nothing; its idle is its waits
        assert timing.recv_s == 0 and timing.idle_s == timing.recv_s + timing.send_s + timing.sync_s
        assert timing.idle_fraction == timing.idle_s / (timing.busy_s + timing.idle_s)
        engine.close()
    assert losses[False] == losses[True] and losses[False][1] < losses[False][0]


def test_a_stage_clock_counts_the_batch_waits_as_idle_and_the_rest_as_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(executor.time, "perf_counter", lambda: now[0])
    link = SimpleNamespace(recv_seconds=1.0, send_seconds=2.0)  # before the batch: not its waits
    clock = StageClock(link)  # type: ignore[arg-type]
    link.recv_seconds += 0.5
    link.send_seconds += 0.25
    now[0] = 101.0
    clock.synced(100.5)  # a cross-stage collective from 100.5 to 101
    now[0] = 104.0
    assert clock.timing() == BatchTiming(busy_s=2.75, idle_s=1.25, recv_s=0.5, send_s=0.25, sync_s=0.5)
    assert clock.timing().idle_fraction == 1.25 / 4
    link.recv_seconds += 10.0  # waits over the batch's wall time (another thread's): all of it idle
    assert (clock.timing().busy_s, clock.timing().idle_s) == (0.0, 4.0)
