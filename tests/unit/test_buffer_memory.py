"""The buffer memory an engine chooses once (see [Note: one buffer memory per engine] in
host/buffer_memory.py): the device's frees a released buffer's storage and allocates it again when
the buffer is taken, and an engine with ``host_page_reuse`` false takes that path on the CPU without
ever touching the host's page functions."""

from __future__ import annotations

import sys

import pytest
import torch

import zeroshard
from zeroshard.host import libc
from zeroshard.host.page_memory import HostPageMemory
from zeroshard.host.page_reserve import PageReserve
from zeroshard.host.buffer_memory import DeviceMemory
from zeroshard.sharding.buffer_pool import BufferPool, KeptBuffers
from zeroshard.tools.demo.model import GPT, GPTConfig

CPU = torch.device("cpu")
CFG = GPTConfig(vocab_size=50, seq_len=8, d_model=16, n_layer=2, n_head=2, attn_bias=False)
on_linux = pytest.mark.skipif(not sys.platform.startswith("linux") or libc.mremap is None,
                              reason="host pages: Linux only")


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


def test_device_memory_frees_storage_on_release_and_allocates_on_refill() -> None:
    memory = DeviceMemory()
    buffer = memory.empty(1000, torch.float32, CPU)
    view = buffer[10:20].view(2, 5)  # what a parameter, or autograd, holds
    assert memory.held_bytes(buffer) == 4000
    memory.release(buffer)
    assert buffer.untyped_storage().nbytes() == 0 and memory.held_bytes(buffer) == 0
    assert view.shape == (2, 5) and buffer.shape == (1000,)  # every view keeps its shape
    memory.release(buffer)  # released twice: still nothing
    memory.refill(buffer)
    assert memory.held_bytes(buffer) == 4000
    buffer.fill_(2.0)
    assert float(view.sum()) == 20.0  # the views see the refilled storage
    memory.refill(buffer)  # allocated already: unchanged
    assert memory.held_bytes(buffer) == 4000
    assert not memory.hand_over(buffer[:500], buffer[500:])  # storage never moves: the caller copies
    memory.park_up_to(1 << 20)
    assert memory.parked_bytes == 0 and not memory.releases_pages
    memory.drop_all()


def test_device_memory_refuses_to_release_part_of_a_storage() -> None:
    memory = DeviceMemory()
    buffer = memory.empty(1000, torch.float32, CPU)
    with pytest.raises(ValueError, match="whole storage"):
        memory.release(buffer[100:])
    with pytest.raises(ValueError, match="whole storage"):
        memory.drop(buffer[:100])
    assert memory.held_bytes(buffer) == 4000  # untouched


def test_kept_buffers_on_the_device_path_free_on_give_back_and_allocate_on_take() -> None:
    buffers = KeptBuffers(CPU, DeviceMemory())
    chunk = buffers.take(0, 300, torch.float32)
    other = buffers.take(1, 100, torch.float64)
    assert buffers.held_bytes() == 300 * 4 + 100 * 8
    buffers.give_back(0)
    assert chunk.untyped_storage().nbytes() == 0 and buffers.held_bytes() == 100 * 8
    again = buffers.take(0, 300, torch.float32)
    assert again is chunk and buffers.held_bytes() == 300 * 4 + 100 * 8  # the same tensor, allocated again
    again.fill_(1.0)
    assert float(again.sum()) == 300.0
    buffers.give_back(0)
    buffers.give_back(1)
    buffers.give_back(7)  # never taken: nothing to do
    assert buffers.held_bytes() == 0 and other.untyped_storage().nbytes() == 0


def test_a_pool_takes_its_buffers_from_its_memory() -> None:
    pool = BufferPool(64, torch.float32, CPU, DeviceMemory())
    first, second = pool.acquire(64), pool.acquire(10)
    assert pool.count == 2 and pool.nbytes == 2 * 64 * 4 and first.numel() == 64 and second.numel() == 10
    pool.release(second)
    assert pool.acquire(30).data_ptr() == second.data_ptr()  # reused, not allocated again
    with pytest.raises(ValueError, match="capacity 64"):
        pool.acquire(65)


def test_host_memory_serves_host_memory_only() -> None:
    assert not HostPageMemory.serves(torch.device("meta"))
    if sys.platform.startswith("linux") and libc.madvise is not None and libc.mincore is not None:
        assert HostPageMemory.serves(CPU)


@on_linux
def test_host_memory_parks_released_pages_for_the_next_refill() -> None:
    memory = HostPageMemory()
    memory.park_up_to(1 << 30)
    first, second = memory.empty(1 << 20, torch.float32, CPU), memory.empty(1 << 20, torch.float32, CPU)
    assert memory.held_bytes(first) == 0  # made with no resident page
    first.fill_(1.0)
    resident = memory.held_bytes(first)
    memory.release(first)
    assert memory.parked_bytes == resident > 0
    memory.refill(second)
    assert memory.reserve.moved_bytes > 0 and memory.parked_bytes < resident
    memory.drop_all()
    assert memory.parked_bytes == 0


def stage3_engine(host_page_reuse: bool) -> tuple[zeroshard.Engine, GPT]:
    torch.manual_seed(0)
    model = GPT(CFG)
    engine, _, _, _ = zeroshard.initialize(model=model, config={
        "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "host_page_reuse": host_page_reuse}})
    return engine, model


def train(engine: zeroshard.Engine, steps: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        data = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=g)
        engine.backward(engine(data[:, :-1], data[:, 1:]))
        engine.step()


def refuse(name: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"{name} called on the device path")
    return refused


def test_an_engine_without_host_page_reuse_never_touches_host_pages(monkeypatch) -> None:
    """Stage 3 in one process with ``host_page_reuse`` false: the one buffer memory is the device's,
    shared by the storage, the gradient chunks and the pools; no page is released, parked, moved or
    measured; a released unit and an idle gradient chunk hold no storage, to the byte; and training
    equals the host's path bitwise."""
    for name in ("madvise", "mincore", "mremap"):
        monkeypatch.setattr(libc, name, refuse(f"libc.{name}"))
    for name in ("give", "fill", "reclaim", "hand_over", "reclaim_range", "drop_all"):
        monkeypatch.setattr(PageReserve, name, refuse(f"PageReserve.{name}"))
    engine, model = stage3_engine(host_page_reuse=False)
    memory = engine.buffer_memory
    assert type(memory) is DeviceMemory
    storage, strategy = engine.storage, engine.strategy
    assert storage.buffer_memory is memory and strategy.grad_chunks.buffers.memory is memory
    assert strategy._bucket_pool.memory is memory
    train(engine, 3)
    units = [b.index for b in storage.layout.buckets if b.index not in storage.persistent]
    assert units and all(storage.held_bytes(i) == 0 for i in units)  # freed between steps
    assert strategy.grad_chunks.buffers.held_bytes() == 0
    breakdown = engine.memory_breakdown()
    assert breakdown["parked_pages"] == 0 and breakdown["gathered_params"] == 0
    with zeroshard.GatheredParameters(list(model.parameters())):
        device_path = {n: p.detach().clone() for n, p in model.named_parameters()}
        gathered = sum(storage.held_bytes(i) for i in units)
    assert gathered == sum(storage.layout.buckets[i].padded_numel * 4 for i in units)  # storage, allocated
    engine.close()
    monkeypatch.undo()

    engine, model = stage3_engine(host_page_reuse=True)
    expected = HostPageMemory if HostPageMemory.serves(CPU) else DeviceMemory
    assert type(engine.buffer_memory) is expected
    train(engine, 3)
    with zeroshard.GatheredParameters(list(model.parameters())):
        for name, param in model.named_parameters():
            assert torch.equal(param, device_path[name]), name
    engine.close()
