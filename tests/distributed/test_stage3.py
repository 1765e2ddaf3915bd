"""Stage 3: exact accounting, the hard cases, GatheredParameters and full_state_dict, in real worlds.

One world per world size runs its cases in turn (``run_family``), each from the same seed with an
engine of its own that it closes; the test then checks every case, and a failure names the case: its
check, stage 3, the world size and the case's arguments.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zs_common import clone, make_model, max_rel_diff, rank_micro_batches, train_zero, zero_config

import zeroshard
from zeroshard.tools.demo.model import GPT
from zeroshard.distributed.collectives import CollectiveError, CommKind
from zeroshard.planning.estimator import EstimateRequest, estimate_stage
from zeroshard.tools.testing import Case, check_family, run_family

SHARD_ALL = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}

def accounting_worker(rank: int, world: int, persistence: int, host_page_reuse: bool = True) -> dict:
    model = make_model()
    zero = {"stage3_param_persistence_threshold": persistence, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 10**6, "host_page_reuse": host_page_reuse}
    engine, _ = train_zero(model, rank, world, 2, micro=1, accum=1, stage=3, **zero)
    engine.comm.reset_counters()
    for x, y in rank_micro_batches(5, rank, world, 1, 1):
        engine.backward(engine(x, y))
        engine.step()
    layout, plan = engine.strategy.layout, engine.strategy.plan  # the trainable buckets
    persistent = [b for b in layout.buckets if b.index in plan.persistent_buckets]
    frozen = [b for b in engine.storage.layout.buckets if b.frozen]  # the frozen layer, sharded too
    out = {
        "mb": engine.memory_breakdown(),
        "counters": {k.value: (c.calls, c.bytes_sent) for k, c in engine.comm.counters.items()},
        "padded": layout.padded_numel, "padded_persistent": sum(b.padded_numel for b in persistent),
        "real_persistent": sum(b.numel for b in persistent), "units": len(plan.units),
        "padded_frozen": sum(b.padded_numel for b in frozen), "frozen_units": len(frozen),
        "buckets": len(layout.buckets), "own": layout.real_numel_in_shard(rank),
        "largest_bucket": max(b.padded_numel for b in layout.buckets),
        "psi": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    engine.close()
    return out


def check_memory_and_communication_are_exact(results: list[dict], persistence: int,
                                             host_page_reuse: bool = True) -> None:
    n = len(results)
    total = 0.0
    for r in results:
        mb, c = r["mb"], r["counters"]
        assert mb["params"] == mb["grads"] == 4 * r["own"]
        if not host_page_reuse:  # storage freed at each release: nothing waits for the next gather
            assert mb["parked_pages"] == 0
        assert mb["optimizer"] == 8 * r["own"]
        assert mb["gathered_params"] == 0  # nothing stays gathered between steps
        # the bucket buffers are kept from one backward to the next ([Note: when the bucket pool lets go])
        buffers, rest = divmod(mb["comm_buffers"], 4 * r["largest_bucket"])
        assert buffers >= 1 and rest == 0
        assert mb["persistent_params"] == 4 * r["real_persistent"]
        total += mb["model_states"]
        sharded = 4 * (r["padded"] - r["padded_persistent"] + r["padded_frozen"])
        one_way = lambda b: (n - 1) * b // n  # noqa: E731
        # forward gather + backward gather of every unit (the frozen layer's too: backward goes through
        # it), one refresh gather of the persistent buckets
        assert r["frozen_units"] == 1
        trainable_units = r["units"] - r["frozen_units"]
        assert c["all_gather"] == (2 * r["units"] + (r["buckets"] - trainable_units),
                                   2 * one_way(sharded) + one_way(4 * r["padded_persistent"]))
        assert c["reduce_scatter"] == (r["buckets"], one_way(4 * r["padded"]))
        assert c["all_reduce"][0] == 1  # the gradient norm
        if persistence == 0:
            assert r["padded_persistent"] == 0
    psi = results[0]["psi"]
    assert total == pytest.approx(n * 16 * psi / n)  # summed over ranks: exactly 16 Psi
    assert estimate_stage(EstimateRequest(psi, n, "fp32"), 3).model_states == pytest.approx(total / n)


class TwiceAndShared(nn.Module):
    """A block called twice, a Linear shared by two blocks, a direct use of a submodule's weight,
    a parameter that no forward uses, and a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 8)
        shared = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh(), shared),
                                     nn.Sequential(shared, nn.Tanh(), nn.Linear(8, 8))])
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.never = nn.Linear(8, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        h = self.blocks[0](h)
        h = self.blocks[0](h)  # called twice
        h = self.frozen(self.blocks[1](h))
        logits = F.linear(h, self.embed.weight)  # a submodule's weight used directly
        return logits.logsumexp(-1).mean()


def hard_cases_worker(rank: int, world: int, prefetch: int, host_page_reuse: bool = True) -> float:
    torch.manual_seed(0)
    ref = TwiceAndShared()
    ours = clone(ref)
    ddp = DDP(ref, find_unused_parameters=True)
    # No weight decay: DDP leaves a never-used parameter's grad None (AdamW skips it), ZeRO gives it a
    # zero gradient (AdamW would still decay it); without decay both leave it unchanged.
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    engine, _, _, _ = zeroshard.initialize(model=ours, config={
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": prefetch, **SHARD_ALL,
                              "host_page_reuse": host_page_reuse}})
    assert engine.strategy.plan.units[-1].name == "<root>"
    for step in range(4):
        idx = torch.randint(0, 13, (2, 5), generator=torch.Generator().manual_seed(step * 7 + rank))
        ddp(idx).backward()
        opt.step()
        opt.zero_grad()
        engine.backward(engine(idx))
        engine.step()
        engine.eval()  # train/eval switching, and a no-grad forward that must release everything
        with torch.no_grad():
            engine(idx)
        assert engine.memory_breakdown()["gathered_params"] == 0
        engine.train()
    with zeroshard.GatheredParameters(list(ours.parameters())):
        diff = max_rel_diff(ours, ref)
    engine.close()
    return diff


def check_hard_cases_match_ddp(results: list[float], prefetch: int, host_page_reuse: bool = True) -> None:
    assert max(results) <= 1e-5


def outside_forward_worker(rank: int, world: int) -> dict:
    model = make_model()
    engine, _ = train_zero(model, rank, world, 1, micro=1, accum=1, stage=3, **SHARD_ALL)
    qkv = model.blocks[1].qkv
    out: dict = {"shape": tuple(qkv.weight.shape)}
    try:
        float(qkv.weight.sum())
        out["read"] = "no error"
    except RuntimeError as err:
        out["read"] = str(err)
    with zeroshard.GatheredParameters([qkv.weight], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                qkv.weight.fill_(0.5)
    with zeroshard.GatheredParameters(qkv.parameters()):
        out["after_modify"] = float(qkv.weight.sum())
    full = engine.full_state_dict(rank0_only=False)
    out["keys_match"] = list(full) == list(GPT(model.cfg).state_dict())
    plain = GPT(model.cfg)
    plain.load_state_dict(full, strict=True)
    out["tied"] = torch.equal(full["tok.weight"], full["head.weight"])
    out["plain_qkv_sum"] = float(plain.blocks[1].qkv.weight.sum())
    only0 = engine.full_state_dict()  # every rank calls it; only rank 0 gets the values
    out["rank0_only_empty"] = (only0 == {}) if rank else bool(only0)
    engine.close()
    return out


def check_sharded_parameters_outside_forward(results: list[dict]) -> None:
    for r in results:
        assert r["shape"] == (48, 16)  # the full shape, never a silent zero-size tensor
        assert "'blocks.1.qkv.weight' is sharded" in r["read"] and "GatheredParameters" in r["read"]
        assert r["after_modify"] == pytest.approx(0.5 * 48 * 16)  # rank 0's change reached every shard
        assert r["keys_match"] and r["tied"] and r["rank0_only_empty"]
        assert r["plain_qkv_sum"] == pytest.approx(0.5 * 48 * 16)


def disabled_gather_worker(rank: int, world: int) -> dict:
    """The same GatheredParameters block (with a modifier rank) disabled, then enabled: what it gathers,
    holds, lets one read, and broadcasts on exit."""
    model = make_model()
    engine, _ = train_zero(model, rank, world, 1, micro=1, accum=1, stage=3, **SHARD_ALL)
    weight = model.blocks[1].qkv.weight
    before = engine.full_state_dict(rank0_only=False)
    out = {}
    for enabled in (False, True):
        engine.comm.reset_counters()
        with zeroshard.GatheredParameters([weight], modifier_rank=0, enabled=enabled):
            seen: dict = {"gathers": engine.comm.counters[CommKind.ALL_GATHER].calls,
                          "held": engine.memory_breakdown()["gathered_params"]}
            try:  # through the module: outside a gather it shows a placeholder in the parameter's place
                seen["read"] = float(model.blocks[1].qkv.weight.sum())
            except RuntimeError as err:
                seen["read"] = str(err)
        seen["broadcasts"] = engine.comm.counters[CommKind.BROADCAST].calls
        seen["held_after"] = engine.memory_breakdown()["gathered_params"]
        out[enabled] = seen
    after = engine.full_state_dict(rank0_only=False)
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["expected_sum"] = float(before["blocks.1.qkv.weight"].sum())
    engine.close()
    return out


def check_disabled_gathered_parameters_gathers_nothing(results: list[dict]) -> None:
    """GatheredParameters(enabled=False) is a no-op at stage 3: no all-gather, nothing held, the
    parameter stays released (reading it is the usual error), no write-back broadcast; the same block
    enabled gathers the unit once and broadcasts once."""
    for r in results:
        off, on = r[False], r[True]
        assert off["gathers"] == 0 and off["held"] == 0 and off["broadcasts"] == 0 and off["held_after"] == 0
        assert "'blocks.1.qkv.weight' is sharded" in off["read"] and "GatheredParameters" in off["read"]
        assert on["gathers"] == 1 and on["held"] > 0 and on["broadcasts"] == 1 and on["held_after"] == 0
        assert on["read"] == pytest.approx(r["expected_sum"], rel=1e-6)
        assert r["unchanged"]


class OneRankBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)])

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if not (skip and i == 1):
                x = block(x)
        return x.sum()


def divergent_worker(rank: int, world: int) -> str:
    """A 3-second ``collective_timeout``: a gather one rank waited for in vain would fail fast."""
    engine, _, _, _ = zeroshard.initialize(model=OneRankBranch(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD"}, "collective_timeout": 3,
        "zero_optimization": {"stage": 3, **SHARD_ALL}})
    try:
        engine.backward(engine(torch.ones(1, 6), skip=rank == 1))
        engine.step()
    except CollectiveError as err:
        return str(err)  # [Note: a case that may break its world runs last]
    engine.close()
    return "no error"


def check_a_module_skipped_on_one_rank_neither_hangs_nor_fails(results: list[str]) -> None:
    """The ranks agree on each gather (values against one process: test_unused_parameters.py)."""
    assert results == ["no error", "no error"]


class StepDependent(nn.Module):
    """Block 1 runs on even steps only (the same on every rank): the recorded order keeps changing."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)])
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i != 1 or self.step % 2 == 0:
                x = torch.tanh(block(x))
        return x.pow(2).mean()


def changing_order_worker(rank: int, world: int) -> float:
    torch.manual_seed(0)
    ref = StepDependent()
    ours = clone(ref)
    ddp = DDP(ref, find_unused_parameters=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine, _, _, _ = zeroshard.initialize(model=ours, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 10**6}})
    for step in range(6):
        ref.step = ours.step = step
        x = torch.randn(2, 6, generator=torch.Generator().manual_seed(step * 3 + rank))
        ddp(x).backward()
        opt.step()
        opt.zero_grad()
        engine.backward(engine(x))
        engine.step()
        assert engine.memory_breakdown()["gathered_params"] == 0
    with zeroshard.GatheredParameters(engine.strategy.params):
        diff = max_rel_diff(ours, ref)
    engine.close()
    return diff


def check_prefetch_survives_a_changing_execution_order(results: list[float]) -> None:
    assert max(results) <= 1e-6


def all_gathers_of_a_step(rank: int, world: int, zero: dict) -> int:
    """All-gathers of one training step with the given stage-3 knobs (after the order is recorded)."""
    engine, _ = train_zero(make_model(), rank, world, 1, micro=1, accum=1, stage=3,
                           stage3_param_persistence_threshold=0, **zero)
    engine.comm.reset_counters()
    for x, y in rank_micro_batches(3, rank, world, 1, 1):
        engine.backward(engine(x, y))
        engine.step()
        assert engine.memory_breakdown()["gathered_params"] == 0
    gathers = engine.comm.counters[CommKind.ALL_GATHER].calls
    engine.close()
    return gathers


#: the reuse knobs compared: every unit released after each use, units kept, units kept under a cap
REUSE_SETTINGS = {"release_all": {"stage3_max_reuse_distance": 0},
                  "keep": {"stage3_max_reuse_distance": 10**9},
                  "keep_capped": {"stage3_max_reuse_distance": 10**9, "stage3_max_live_parameters": 1}}


def reuse_worker(rank: int, world: int) -> dict[str, int]:
    return {name: all_gathers_of_a_step(rank, world, zero) for name, zero in REUSE_SETTINGS.items()}


def check_reuse_distance_and_live_parameter_limits_are_honoured(results: list[dict[str, int]]) -> None:
    gathers = results[0]
    units = 4  # two blocks, the root, and block 0's frozen layer (stage 3 shards it too)
    assert gathers["release_all"] == 2 * units  # gathered for forward, again for backward
    assert gathers["keep"] < gathers["release_all"]  # units reused soon after their forward stay gathered for backward
    assert gathers["keep_capped"] == gathers["release_all"]  # ... unless that would exceed the live-parameter limit


def gather_order_worker(rank: int, world: int, prefetch: int) -> list[list[tuple[str, str]]]:
    """Per training step, in order: each all-gather the collectives layer launches and each wait for one
    (by the unit its label names), and each block's forward and backward beginning.  Blocks are
    released after each use (reuse distance 0), so each is gathered once for forward, once for backward."""
    model = make_model()
    model.blocks[0].fc.requires_grad_(True)  # one unit per block (a frozen layer would be a unit of its own)
    engine, _, _, _ = zeroshard.initialize(model=model, config=zero_config(
        3, 1, 1, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
        stage3_prefetch_bucket_size=prefetch))
    assert engine.storage.comm is engine.comm
    events: list[tuple[str, str]] = []
    launch = engine.comm.all_gather

    def logged_all_gather(full, shard, label, async_op=False):
        unit = label.removeprefix("gather[").split(":")[0]  # the label is "gather[blocks.1: its params]"
        events.append(("gather", unit))
        pending = launch(full, shard, label, async_op)
        wait = pending.wait

        def logged_wait() -> None:  # the gathered values are needed now
            events.append(("wait", unit))
            wait()

        pending.wait = logged_wait  # type: ignore[method-assign]
        return pending

    engine.comm.all_gather = logged_all_gather  # type: ignore[method-assign]
    for i, block in enumerate(model.blocks):
        name = f"blocks.{i}"

        def on_output(module, args, output, name=name):
            # registered before the engine's own gradient hook on this output: runs just before it
            output.register_hook(lambda grad: events.append(("backward", name)))

        # prepend: these run before the engine's hooks, which gather on demand
        block.register_forward_pre_hook(lambda module, args, name=name: events.append(("forward", name)),
                                        prepend=True)
        block.register_forward_hook(on_output, prepend=True)
    steps = []
    for step in range(2):
        events.clear()
        for x, y in rank_micro_batches(step, rank, world, 1, 1):
            engine.backward(engine(x, y))
            engine.step()
        steps.append(list(events))
    engine.close()
    return steps


def check_prefetch_gathers_ahead_of_use(results: list[list[list[tuple[str, str]]]], prefetch: int) -> None:
    """With prefetch, once the order is recorded (the first step), each block's all-gather is launched
    before the block starts: in forward before the previous block has even finished, in backward before
    the block's gradient arrives.  Without prefetch (and on the recording pass) a block is gathered only
    when it starts."""
    for first, second in results:
        blocks = ["blocks.0", "blocks.1"]
        for step, events in (("first", first), ("second", second)):
            ahead = prefetch > 0 and step == "second"
            gathered = [u for kind, u in events if kind == "gather" and u != "<root>"]
            # each block twice (for forward, then for backward): a prefetch replaces a gather, never adds one
            assert sorted(gathered) == sorted(blocks * 2), (step, events)
            if not ahead:
                assert gathered == blocks + blocks[::-1], (step, events)
            fwd = {u: events.index(("forward", u)) for u in blocks}
            bwd = {u: events.index(("backward", u)) for u in blocks}
            fwd_gather = {u: events.index(("gather", u)) for u in blocks}
            bwd_gather = {u: max(i for i, e in enumerate(events) if e == ("gather", u)) for u in blocks}
            fwd_wait = {u: events.index(("wait", u)) for u in blocks}
            assert all(fwd_gather[u] < bwd_gather[u] for u in blocks)
            for u in blocks:
                if ahead:  # launched before the block starts, waited for only when it does
                    assert fwd_gather[u] < fwd[u] < fwd_wait[u] and bwd_gather[u] < bwd[u], (u, events)
                else:  # right after the block starts: its own gather, and at once the wait for it
                    assert fwd_gather[u] == fwd[u] + 1 == fwd_wait[u] - 1, (u, events)
                    assert bwd_gather[u] == bwd[u] + 1, (u, events)
            # a budget that holds both blocks: unit k+1's all-gather is launched before block 0's forward
            # begins and waited for after it; in backward (blocks in reverse) launched before block 1's
            # gradient arrives.  A budget smaller than a block prefetches the next unit only, as each
            # unit starts (above).
            deep = ahead and prefetch > 1
            assert (fwd_gather["blocks.1"] < fwd["blocks.0"] < fwd_wait["blocks.1"]) == deep, events
            assert (bwd_gather["blocks.0"] < bwd["blocks.1"]) == deep, events


def page_release_worker(rank: int, world: int, host_page_reuse: bool = True) -> dict:
    """Units of ~800 KB (hundreds of whole pages): what each full buffer holds, measured (resident pages
    with mincore, or storage bytes), between steps and while its block runs; and whether the buffers keep
    their storage."""
    from zeroshard.tools.demo.model import GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=128, n_layer=2, n_head=2))
    engine, *_ = zeroshard.initialize(model=model, config=zero_config(3, 2, 1, **SHARD_ALL,
                                                                      host_page_reuse=host_page_reuse))
    storage = engine.storage
    memory = storage.buffer_memory
    units = [b.index for b in storage.layout.buckets if b.index not in storage.persistent]
    addresses = [storage.full[i].untyped_storage().data_ptr() for i in units]
    seen: dict = {"while_running": [], "between_steps": [], "memory": type(memory).__name__,
                  "shared": memory is engine.buffer_memory is engine.strategy.grad_chunks.buffers.memory}
    block_unit = next(u.bucket_index for u in engine.strategy.plan.units if u.module is model.blocks[1])
    model.blocks[1].register_forward_pre_hook(  # after the scheduler's own pre-hook, which gathers
        lambda *_: seen["while_running"].append(storage.held_bytes(block_unit)))
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    chunks = engine.strategy.grad_chunks.buffers  # [Note: where gradient chunks live]
    seen["chunks_after_backward"], seen["chunks_between_steps"], seen["breakdown_parked"] = [], [], []
    for _ in range(2):
        engine.backward(engine(x, x))
        seen["chunks_after_backward"].append(chunks.held_bytes())
        engine.step()
        seen["between_steps"].append(sum(storage.held_bytes(i) for i in units))
        seen["chunks_between_steps"].append(chunks.held_bytes())
        seen.setdefault("parked", []).append(memory.parked_bytes)
        seen["breakdown_parked"].append(engine.memory_breakdown()["parked_pages"])
    trainable = [b for b in storage.layout.buckets if not b.frozen]
    seen["chunk_bytes"] = sum(b.shard_numel * 4 for b in trainable)
    seen["chunk_slack"] = len(trainable) * 2 * 4096  # the partial pages at either end of each chunk
    seen["unit_bytes"] = storage.full[block_unit].numel() * 4
    seen["same_storage"] = addresses == [storage.full[i].untyped_storage().data_ptr() for i in units]
    reserve = getattr(memory, "reserve", None)  # the host's page reserve
    seen["capacity"] = reserve.capacity if reserve is not None else 0
    seen["moved"] = reserve.moved_bytes if reserve is not None else 0
    engine.close()
    seen["parked_after_close"] = memory.parked_bytes
    return seen


def check_releases_a_units_pages_and_keeps_its_buffer(results: list[dict], host_page_reuse: bool = True) -> None:
    """[Note: releasing a gathered unit's pages]: between steps a unit holds no resident page of its own,
    only pages parked for the next gather ([Note: released pages move to the next gather]), no more than
    the reserve's capacity, and pages did move from buffer to buffer; while a block runs its unit is
    resident (all but the partial pages at its ends); the buffers never move; closing drops what is
    parked.  With ``host_page_reuse`` false, the GPU's path ([Note: one buffer memory per engine]): a
    released unit's storage and an idle gradient chunk's are freed, to the byte, and nothing is parked."""
    for seen in results:
        assert seen["shared"]  # one buffer memory for the storage, the gradient chunks and the engine
        if not host_page_reuse:
            assert seen["memory"] == "DeviceMemory"
            assert seen["between_steps"] == [0, 0] and seen["chunks_between_steps"] == [0, 0]
            assert seen["while_running"] and all(held == seen["unit_bytes"] for held in seen["while_running"])
            assert seen["chunks_after_backward"] == [seen["chunk_bytes"]] * 2
            assert seen["parked"] == seen["breakdown_parked"] == [0, 0] and seen["moved"] == 0
            continue
        assert seen["memory"] == "HostPageMemory"
        assert seen["breakdown_parked"] == seen["parked"]
        assert all(held <= parked <= seen["capacity"] for held, parked in zip(seen["between_steps"], seen["parked"]))
        assert seen["moved"] > 0 and seen["parked_after_close"] == 0
        assert seen["while_running"] and all(
            seen["unit_bytes"] - 8192 <= held <= seen["unit_bytes"] for held in seen["while_running"])
        assert seen["same_storage"]
        # the gradient chunks, kept for the run, hold their own pages from backward to the step only:
        # between steps whatever units and chunks hold is parked
        assert all(units + chunks <= parked for units, chunks, parked
                   in zip(seen["between_steps"], seen["chunks_between_steps"], seen["parked"])), seen
        assert all(seen["chunk_bytes"] - seen["chunk_slack"] <= held <= seen["chunk_bytes"]
                   for held in seen["chunks_after_backward"])


def lent_chunk_worker(rank: int, world: int, host_page_reuse: bool = True) -> dict:
    """DeepSpeed's default reuse distance (every unit stays gathered from its forward to its backward):
    what the store holds of the units' chunks after forward and between steps, measured with mincore."""
    from zeroshard.tools.demo.model import GPTConfig
    from zeroshard.host.page_release import resident_bytes

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=128, n_layer=2, n_head=2))
    engine, *_ = zeroshard.initialize(model=model, config=zero_config(3, 2, 1, stage3_param_persistence_threshold=0,
                                                                      host_page_reuse=host_page_reuse))
    storage = engine.storage
    units = [b for b in storage.layout.buckets if b.index not in storage.persistent]
    seen: dict = {key: [] for key in ("lent_after_forward", "resident_after_forward", "lent_between_steps",
                                      "resident_between_steps", "losses")}

    def resident() -> int:  # the store's own pages under the units' chunks, not through shard_view
        return sum(resident_bytes(storage.store.view(b)) for b in units)

    for seed in range(3):
        g = torch.Generator().manual_seed(seed * world + rank)
        x = torch.randint(0, 64, (2, 8), generator=g)
        loss = engine(x, x)
        seen["lent_after_forward"].append(storage.lent_bytes())
        seen["resident_after_forward"].append(resident())
        engine.backward(loss)
        engine.step()
        seen["lent_between_steps"].append(storage.lent_bytes())
        seen["resident_between_steps"].append(resident())
        seen["losses"].append(float(loss))
    seen["chunk_bytes"] = sum(b.shard_numel * 4 for b in units)
    seen["chunk_slack"] = len(units) * 2 * 4096  # the partial pages at either end of each chunk
    engine.close()
    return seen


def check_a_gathered_unit_borrows_this_ranks_chunk(results: list[dict], host_page_reuse: bool = True) -> None:
    """[Note: a gathered unit borrows this rank's chunk]: from the second forward on (the first records
    the order, so its units are released after their forward), every unit is gathered from forward to
    backward and the store holds none of their chunks' whole pages; between steps the store holds them
    all and nothing is lent.  With ``host_page_reuse`` false (the GPU's path) nothing is ever lent and
    the store keeps its chunks throughout.  World 3: the chunks are ragged."""
    for seen in results:
        chunk, slack = seen["chunk_bytes"], seen["chunk_slack"]
        if host_page_reuse:
            assert seen["lent_after_forward"][1:] == [chunk, chunk], seen
            assert seen["resident_after_forward"][1:] == [0, 0], seen
        else:
            assert seen["lent_after_forward"] == [0, 0, 0], seen
            assert all(chunk - slack <= held <= chunk for held in seen["resident_after_forward"]), seen
        assert seen["lent_between_steps"] == [0, 0, 0]
        assert all(chunk - slack <= held <= chunk for held in seen["resident_between_steps"]), seen
        assert all(0 < loss < 10 for loss in seen["losses"])


#: each case's worker, and the check of its results (one per rank) in the test
WORKERS: dict[str, Callable[..., Any]] = {
    "memory_and_communication_are_exact": accounting_worker,
    "hard_cases_match_ddp": hard_cases_worker,
    "sharded_parameters_outside_forward": outside_forward_worker,
    "disabled_gathered_parameters_gathers_nothing": disabled_gather_worker,
    "a_module_skipped_on_one_rank_neither_hangs_nor_fails": divergent_worker,
    "prefetch_survives_a_changing_execution_order": changing_order_worker,
    "reuse_distance_and_live_parameter_limits_are_honoured": reuse_worker,
    "prefetch_gathers_ahead_of_use": gather_order_worker,
    "releases_a_units_pages_and_keeps_its_buffer": page_release_worker,
    "a_gathered_unit_borrows_this_ranks_chunk": lent_chunk_worker,
}
CHECKS: dict[str, Callable[..., None]] = {
    "memory_and_communication_are_exact": check_memory_and_communication_are_exact,
    "hard_cases_match_ddp": check_hard_cases_match_ddp,
    "sharded_parameters_outside_forward": check_sharded_parameters_outside_forward,
    "disabled_gathered_parameters_gathers_nothing": check_disabled_gathered_parameters_gathers_nothing,
    "a_module_skipped_on_one_rank_neither_hangs_nor_fails": check_a_module_skipped_on_one_rank_neither_hangs_nor_fails,
    "prefetch_survives_a_changing_execution_order": check_prefetch_survives_a_changing_execution_order,
    "reuse_distance_and_live_parameter_limits_are_honoured": check_reuse_distance_and_live_parameter_limits_are_honoured,
    "prefetch_gathers_ahead_of_use": check_prefetch_gathers_ahead_of_use,
    "releases_a_units_pages_and_keeps_its_buffer": check_releases_a_units_pages_and_keeps_its_buffer,
    "a_gathered_unit_borrows_this_ranks_chunk": check_a_gathered_unit_borrows_this_ranks_chunk,
}

# [Note: a case that may break its world runs last]
# The divergent case ends its world: should a rank raise there, the engine it leaves may hold
# collectives the other rank never joins, and no case after it could run.

#: by world size, in the order they run
#: ``host_page_reuse: False``: the GPU's path on the CPU (see [Note: one buffer memory per engine] in
#: host/buffer_memory.py), run beside the host's in the same worlds
DEVICE_PATH = {"host_page_reuse": False}
DEFAULT_CASES: dict[int, list[Case]] = {
    2: [("releases_a_units_pages_and_keeps_its_buffer", {}),
        ("releases_a_units_pages_and_keeps_its_buffer", DEVICE_PATH),
        ("hard_cases_match_ddp", {"prefetch": 0}), ("hard_cases_match_ddp", {"prefetch": 10**6}),
        ("hard_cases_match_ddp", {"prefetch": 10**6, **DEVICE_PATH}),
        ("disabled_gathered_parameters_gathers_nothing", {}),
        ("prefetch_survives_a_changing_execution_order", {}),
        # a budget of one element, smaller than any unit: the next unit is prefetched all the same (see
        # [Note: the next unit is always prefetched] in zeroshard/sharding/stage3/gather_scheduler.py)
        ("prefetch_gathers_ahead_of_use", {"prefetch": 1}),
        ("a_module_skipped_on_one_rank_neither_hangs_nor_fails", {})],
    3: [("a_gathered_unit_borrows_this_ranks_chunk", {}),  # world 3: ragged chunks
        ("a_gathered_unit_borrows_this_ranks_chunk", DEVICE_PATH),
        ("sharded_parameters_outside_forward", {})],
}
EXTENDED_CASES: dict[int, list[Case]] = {
    2: [("reuse_distance_and_live_parameter_limits_are_honoured", {}),
        ("prefetch_gathers_ahead_of_use", {"prefetch": 0}), ("prefetch_gathers_ahead_of_use", {"prefetch": 10**6})],
    3: [("memory_and_communication_are_exact", {"persistence": 0}),
        ("memory_and_communication_are_exact", {"persistence": 20}),
        ("memory_and_communication_are_exact", {"persistence": 20, **DEVICE_PATH})],
}


def labels(name: str, world: int, arguments: dict[str, Any]) -> dict[str, Any]:
    """How a case is named in failures: its check, the stage, the world size and its arguments."""
    return {"check": name, "stage": 3, "world": world, **arguments}


def check_cases(world: int, cases: list[Case]) -> None:
    check_family(cases, run_family(world, cases, WORKERS, labels=labels), CHECKS, world, labels=labels)


@pytest.mark.parametrize("world", sorted(DEFAULT_CASES))
def test_stage3_cases(world: int) -> None:
    """World 2: a unit's pages released and its buffer kept, the hard cases against DDP (prefetch off and
    on), GatheredParameters disabled, prefetch under a changing execution order, units larger than the
    prefetch budget prefetched, a module one rank skips.
    World 3: a gathered unit borrows this rank's chunk, sharded parameters outside forward.  The release,
    the hard cases and the borrowed chunk also on the GPU's path (``host_page_reuse`` false)."""
    check_cases(world, DEFAULT_CASES[world])


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
@pytest.mark.parametrize("world", sorted(EXTENDED_CASES))
def test_stage3_extended_cases(world: int) -> None:
    """World 2: the reuse distance and live-parameter limits, prefetch gathers ahead of use (off and on).
    World 3: memory and communication exact (persistence 0 and 20, and 20 on the GPU's path)."""
    check_cases(world, EXTENDED_CASES[world])
