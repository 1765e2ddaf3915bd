"""The CUDA path's decisions, checked on the CPU: how a collective is waited for, which device a rank
trains on, a LOCAL_RANK beyond the host's devices, what the world's device policy answers (pure
functions), and the order in which stage 3 moves a model to the device (one process)."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Optional

import pytest
import torch

import zeroshard
from zeroshard.device import CUDADevice, HostDevice, device_policy
from zeroshard.distributed.collectives import CommCounter, PendingCollective
from zeroshard.distributed.world import LocalRankError, World, backend_for, check_local_rank, choose_device
from zeroshard.engine import placement
from zeroshard.sharding.stage3.shard_store import ShardStore
from zeroshard.tools.demo.model import GPT, GPTConfig


class FakeWork:
    """What ``PendingCollective`` sees of a ``torch.distributed`` Work: how ``wait`` was called."""

    def __init__(self) -> None:
        self.calls: list[Optional[Any]] = []

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        self.calls.append(kwargs.get("timeout", args[0] if args else None))
        return True

    def is_completed(self) -> bool:
        return True


def test_a_device_collective_is_waited_for_without_a_host_timeout() -> None:
    work = FakeWork()
    PendingCollective(work, "bucket", CommCounter(), timeout_s=5.0, on_device=True).wait()
    assert work.calls == [None]  # NCCL: the stream waits; a timeout would poll on the host


def test_a_host_collective_is_waited_for_with_the_config_timeout() -> None:
    work = FakeWork()
    PendingCollective(work, "bucket", CommCounter(), timeout_s=5.0).wait()
    assert work.calls == [datetime.timedelta(seconds=5.0)]


@pytest.mark.parametrize("config, cuda, count, local_rank, expected", [
    ("nccl", True, 2, 1, "cuda:1"),
    ("cuda:nccl", True, 1, 0, "cuda:0"),  # init_process_group() without a backend, torch >= 2.6
    ("cpu:gloo,cuda:nccl", True, 4, 3, "cuda:3"),  # init_process_group() without a backend, older torch
    ("cpu:gloo,cuda:gloo", True, 2, 0, "cpu"),  # init_process_group("gloo"): the user asked for gloo
    ("gloo", True, 2, 0, "cpu"),
    ("cpu:gloo,cuda:nccl", False, 0, 0, "cpu"),  # no CUDA: the CPU whatever the group says
    ("nccl", False, 0, 1, "cpu"),
    ("none", True, 1, 0, "cuda:0"),  # a lone process on a GPU host
    ("none", False, 0, 0, "cpu"),
])
def test_the_device_follows_the_group_and_cuda(config: str, cuda: bool, count: int, local_rank: int,
                                               expected: str) -> None:
    assert choose_device(config, cuda, count, local_rank) == torch.device(expected)


@pytest.mark.parametrize("config, device, expected", [
    ("cpu:gloo,cuda:nccl", "cuda", "nccl"), ("cpu:gloo,cuda:nccl", "cpu", "gloo"), ("cuda:nccl", "cuda", "nccl"),
    ("nccl", "cuda", "nccl"), ("gloo", "cpu", "gloo"), ("cpu:gloo,cuda:gloo", "cpu", "gloo"),
])
def test_the_world_names_the_backend_of_its_device(config: str, device: str, expected: str) -> None:
    assert backend_for(config, torch.device(device)) == expected


def test_a_local_rank_beyond_the_devices_is_refused_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(LocalRankError, match=r"LOCAL_RANK 1 but this host has 1 CUDA device\(s\): launch at most 1 "):
        choose_device("nccl", True, 1, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(LocalRankError, match=r"has 2 CUDA device\(s\) \(CUDA_VISIBLE_DEVICES='0,1'\).*CUDA_VISIBLE"):
        check_local_rank(2, 2)
    check_local_rank(1, 2)
    assert choose_device("gloo", True, 1, 5) == torch.device("cpu")  # no device asked for: nothing to check


def test_the_world_holds_the_policy_of_its_device() -> None:
    """The parts ask ``world.device_policy`` (see [Note: the device decided once] in device/policy.py): a
    GPU run page-locks its host buffers and records events after copies that do not wait; a CPU run,
    also on a GPU host (a gloo world), does neither."""
    gpu = World(0, 2, 1, torch.device("cuda", 1), "nccl")
    assert gpu.device_policy == CUDADevice(torch.device("cuda", 1))
    assert gpu.device_policy.is_accelerator and gpu.device_policy.pin_host_memory
    cpu = dataclasses.replace(gpu, device=torch.device("cpu"), backend="gloo")  # follows the device it is given
    assert cpu.device_policy == HostDevice(torch.device("cpu")) == device_policy(torch.device("cpu"))
    assert not cpu.device_policy.is_accelerator and not cpu.device_policy.pin_host_memory
    assert cpu.device_policy.record_event() is None and cpu.device_policy.peak_bytes() == 0
    cpu.device_policy.synchronize()
    state = cpu.device_policy.rng_state()
    torch.rand(3)
    cpu.device_policy.set_rng_state(state)
    assert torch.equal(cpu.device_policy.rng_state(), state)


def test_stage3_moves_parameters_to_the_device_as_their_buckets_fill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 3 never moves the whole model to the device: each parameter is moved as its bucket is filled,
    so between two buckets' chunks being stored only the next bucket's parameters have moved (on a CPU the
    move hands back the tensor itself; the order is the GPU's)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, seq_len=8, d_model=16, n_layer=2, n_head=2, attn_bias=False))
    model.blocks[0].fc.requires_grad_(False)  # frozen: sharded in a bucket of its own
    model.blocks[1].ln1.requires_grad_(False)  # frozen and small: kept whole, moved after the buckets
    name_at = {p.data_ptr(): name for name, p in model.named_parameters()}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    events: list[tuple[str, Any]] = []
    move, write = placement.to_device, ShardStore.write

    def watched_move(values: torch.Tensor, device: torch.device) -> torch.Tensor:
        events.append(("move", name_at[values.data_ptr()]))
        return move(values, device)

    def watched_write(store: ShardStore, bucket: Any, start: int, values: torch.Tensor) -> None:
        events.append(("write", {slot.name for slot in bucket.slots}))
        write(store, bucket, start, values)

    monkeypatch.setattr(placement, "to_device", watched_move)
    monkeypatch.setattr(ShardStore, "write", watched_write)
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 600, "stage3_param_persistence_threshold": 20}})
    monkeypatch.setattr(ShardStore, "write", write)
    buckets = [names for kind, names in events if kind == "write"]
    assert len(buckets) >= 3 and any("blocks.0.fc.weight" in names for names in buckets)
    moved: set[str] = set()
    for kind, what in events:
        if kind == "move":
            moved.add(what)
        else:  # a bucket's chunk is stored: exactly its own parameters have moved since the last one
            assert moved == what, (moved, what)
            moved = set()
    assert moved == {"blocks.1.ln1.weight", "blocks.1.ln1.bias"}  # kept whole: after the buckets
    with zeroshard.GatheredParameters(list(model.parameters())):
        for name, p in model.named_parameters():
            assert torch.equal(p, before[name]), name
    engine.close()
