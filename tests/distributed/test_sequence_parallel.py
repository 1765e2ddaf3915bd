"""Sequence parallelism (DeepSpeed-Ulysses) trains like one process on the whole sequences.

A small causal attention model (token and position embeddings, two blocks of attention through
``DistributedAttention`` with torch's ``scaled_dot_product_attention`` as the local attention and an
MLP, a head) trains 3 steps with ``sequence_parallel_size`` 2 at ZeRO stages 0-3: each rank holds its
slice of every sequence of its data-parallel index's batch, and its loss is the mean over its own
tokens ([Note: the loss and the gradient average under sequence parallelism] in zeroshard/sequence/layer.py).
The oracle is one process training the same model on every data-parallel index's whole sequences at
once (fp32, 1e-5 relative): with plain SGD, which is not scale-invariant, so a gradient off by the
sequence degree shows, and with AdamW.  The mean of the ranks' losses equals the oracle's loss at every
step, ``deepspeed.utils.groups`` answers from the engine's axes, the exchanges are counted in the
engine's ledger, and the loader of ``initialize(training_data=...)`` gives a sequence group's ranks the
same samples.  Grouped-query attention with fewer key/value heads than ranks replicates them; over a
process group of the user's the two exchanges invert each other exactly.  With ``sequence_parallel.mode``
``"ring"`` the same model trains the same way through the ring (zeroshard/sequence/ring.py), with a head
count the degree does not divide (3 heads at degree 2) and, in the world of four, a degree above the head
count (2 heads at degree 4), in the consecutive layout and with head-tail sharding (each rank holding
chunks r and 2P - 1 - r of its sequences); its bytes are counted in the ledger as
docs/SEQUENCE_PARALLEL.md says, and it refuses, before any message, arguments for the local attention
and key/value heads that do not divide the query heads.
At sequence 2 x data 1 the same equality holds with gradient accumulation and clipping (AdamW, ZeRO-2),
activation checkpointing (``checkpoint_modules``, ZeRO-3), the optimizer offloaded to the CPU (AdamW,
ZeRO-3) and, within bf16's tolerance, bf16 (ZeRO-1); the ledger's exchange bytes equal
``zeroshard estimate``'s ([Note: sequence parallel estimates] in zeroshard/planning/estimator.py), and the
bytes a rank's forward saves for backward (``engine.measure_activations()``) are about half of a whole
sequence's, far less with each block checkpointed.
In the world of four, a checkpoint saved at sequence 2 x data 2 (ZeRO-3) resumes at sequence 1 x data 4
(ZeRO-2) and sequence 4 x data 1 (ZeRO-1): the ZeRO world is the same four ranks, split otherwise.
Refused by name on every rank: heads that do not split over the ranks, a degree that does not divide
the world, slices of unequal length in one sequence group (before any exchange), and a sequence axis
with pipeline or tensor parallelism.

The default suite runs the world of two (sequence 2 x data 1); the world of four (sequence 2 x data 2,
and the ring at sequence 4 x data 1) is an extended test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.deepspeed.utils import groups as ds_groups
from zeroshard.distributed.parallel_dims import SequenceParallelSizeError
from zeroshard.planning.estimator import EstimateRequest, ModelShape, SequenceShape, sequence_exchange_bytes
from zeroshard.checkpointing import checkpoint_modules
from zeroshard.sequence import DistributedAttention, SequenceParallelError, sequence_positions
from zeroshard.tools.testing import check_family, free_port, run_family

V, D, HEADS, LAYERS, SEQ, ROWS, STEPS, SP = 23, 16, 4, 2, 8, 2, 3, 2
OPTIMIZERS = {"SGD": {"type": "SGD", "params": {"lr": 0.5}},
              "AdamW": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}


class LocalAttention(nn.Module):
    """Causal attention over whole sequences, ``[b, s, heads, head_dim]`` in and out; key/value heads
    fewer than the query heads are shared by consecutive query heads (grouped-query attention)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class Elementwise(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q * k + v


class Block(nn.Module):
    def __init__(self, kv_heads: int, heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, D // HEADS
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        # no bias: a key bias has no gradient but rounding noise (softmax ignores a shift shared by every
        # key), which AdamW's first steps blow up to the learning rate
        self.qkv = nn.Linear(D, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(heads * self.head_dim, D)
        self.attention = DistributedAttention(LocalAttention(), None, scatter_idx=2, gather_idx=1)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        kv = self.kv_heads * self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * self.head_dim, kv, kv], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim)
        k, v = (t.view(b, s, self.kv_heads, self.head_dim) for t in (k, v))
        x = x + self.out(self.attention(q, k, v).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class AttentionModel(nn.Module):
    def __init__(self, kv_heads: int = HEADS, heads: int = HEADS) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(V, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block(kv_heads, heads) for _ in range(LAYERS))
        self.head = nn.Linear(D, V)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).reshape(-1, V), labels.reshape(-1))


def model(kv_heads: int = HEADS, heads: int = HEADS) -> AttentionModel:
    torch.manual_seed(0)
    return AttentionModel(kv_heads, heads)


def batch(step: int, data: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + data)
    return torch.randint(0, V, (ROWS, SEQ), generator=g), torch.randint(0, V, (ROWS, SEQ), generator=g)


def local_slice(step: int, data: int, seq: int, sp: int = SP,
                balanced: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``seq`` of a sequence group's share of data-parallel index ``data``'s batch: consecutive slices,
    or with ``balanced`` the ring's head-tail chunks."""
    tokens, labels = batch(step, data)
    part = sequence_positions(SEQ, seq, sp, balanced)
    positions = part.expand(ROWS, -1)
    return tokens[:, part], positions, labels[:, part]


def reference(optimizer: str, dp: int | Sequence[int], kv_heads: int = HEADS,
              heads: int = HEADS) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process on every data-parallel index's whole sequences at once; ``dp`` is the data degree of
    every one of ``STEPS`` steps, or one degree a step (as many steps as degrees)."""
    net = model(kv_heads, heads)
    spec = OPTIMIZERS[optimizer]
    opt = getattr(torch.optim, spec["type"])(net.parameters(), **spec["params"])
    losses = []
    for step, degree in enumerate([dp] * STEPS if isinstance(dp, int) else dp):
        tokens, labels = (torch.cat(parts) for parts in zip(*(batch(step, d) for d in range(degree))))
        loss = net(tokens, torch.arange(SEQ).expand(len(tokens), -1), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, losses


def config(stage: int, optimizer: str, sp: int = SP, **extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": ROWS, "sequence_parallel_size": sp, "collective_timeout": 60,
            "optimizer": OPTIMIZERS[optimizer],
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                                  "stage3_param_persistence_threshold": 0}, **extra}


def train_worker(rank: int, world: int, stage: int, optimizer: str, kv_heads: int = HEADS, heads: int = HEADS,
                 mode: str = "ulysses", sp: int = SP, balanced: bool = False) -> dict[str, Any]:
    expected, expected_losses = reference(optimizer, world // sp, kv_heads, heads)
    net = model(kv_heads, heads)
    engine, _, _, _ = zeroshard.initialize(model=net, config=config(stage, optimizer, sp,
                                                                    sequence_parallel={"mode": mode,
                                                                                       "load_balance": balanced}))
    log = engine.comm.ledger.start_log()
    where = engine.parallel_dims.coords(rank)
    losses = []
    for step in range(STEPS):
        loss = engine(*local_slice(step, where.data, where.seq, sp, balanced))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    state = engine.full_state_dict(rank0_only=False)
    worst = max(float((state[n] - v).abs().max()) / (float(v.abs().max()) or 1.0) for n, v in expected.items())
    accessors = (ds_groups._get_sequence_parallel_world_size(), ds_groups._get_sequence_parallel_rank(),
                 ds_groups._get_sequence_data_parallel_world_size(), ds_groups._get_sequence_data_parallel_rank(),
                 torch.distributed.get_process_group_ranks(ds_groups._get_sequence_parallel_group()))
    exchanges = sorted({(r.label, r.group_size) for r in log if r.label.startswith("sequence_")})
    sent = {label: sum(r.sent for r in log if r.label == label) for label, _ in exchanges}
    refused = ring_refusals(net.blocks[0].attention, heads) if mode == "ring" else {}
    engine.close()
    return {"worst": worst, "losses": losses, "expected_losses": expected_losses, "accessors": accessors,
            "exchanges": exchanges, "sent": sent, "train_batch_size": engine.train_batch_size(), "sp": where.seq,
            "after_close": ds_groups._get_sequence_parallel_world_size(), "refused": refused}


COMBINED = {  # each case: (ZeRO stage, optimizer, extra config, relative tolerance against fp32)
    "accumulation and clipping": (2, "AdamW", {"gradient_accumulation_steps": 2, "gradient_clipping": 0.05}, 1e-5),
    "activation checkpointing": (3, "SGD", {}, 1e-5),
    "offload": (3, "AdamW", {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, 1e-5),
    "bf16": (1, "SGD", {"bf16": {"enabled": True}}, 2e-2),
}


def combined_reference(optimizer: str, micro_steps: int, clip: float) -> tuple[dict[str, torch.Tensor], float]:
    """One process, data degree 1: each optimizer step the mean over ``micro_steps`` micro-batches' whole
    sequences, clipped to ``clip`` (0: off); also the largest gradient norm before clipping."""
    net = model()
    spec = OPTIMIZERS[optimizer]
    opt = getattr(torch.optim, spec["type"])(net.parameters(), **spec["params"])
    largest = 0.0
    for step in range(STEPS):
        tokens, labels = (torch.cat(parts) for parts in zip(*(batch(step * micro_steps + m, 0)
                                                              for m in range(micro_steps))))
        net(tokens, torch.arange(SEQ).expand(len(tokens), -1), labels).backward()
        largest = max(largest, float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip or float("inf"))))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, largest


def combined_worker(rank: int, world: int, case: str) -> dict[str, Any]:
    """Sequence 2 x data 1 with one of ``COMBINED``'s features: the weights' worst relative difference
    from one process on the whole sequences."""
    stage, optimizer, extra, _ = COMBINED[case]
    settings = config(stage, optimizer)
    for key, value in extra.items():
        settings[key] = {**settings[key], **value} if isinstance(value, dict) and key in settings else value
    micro_steps = settings.get("gradient_accumulation_steps", 1)
    expected, largest = combined_reference(optimizer, micro_steps, settings.get("gradient_clipping", 0.0))
    net = model()
    if case == "activation checkpointing":
        checkpoint_modules(net, Block)
    engine = zeroshard.initialize(model=net, config=settings)[0]
    seq = engine.parallel_dims.coords(rank).seq
    for step in range(STEPS * micro_steps):
        tokens, positions, labels = local_slice(step, 0, seq)
        engine.backward(engine(tokens, positions, labels))
        engine.step()
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    worst = max(float((state[n].float() - v).abs().max()) / (float(v.abs().max()) or 1.0) for n, v in expected.items())
    return {"worst": worst, "largest norm": largest}


def check_combined(by_rank: list[dict[str, Any]], case: str) -> None:
    tolerance = COMBINED[case][3]
    for rank, result in enumerate(by_rank):
        assert result["worst"] <= tolerance, f"rank {rank}, {case}: the weights are off by {result['worst']:.2e}"
        if "clipping" in case:
            assert result["largest norm"] > 2 * COMBINED[case][2]["gradient_clipping"], "clipping never acted"


def sgd_steps(engine: Any, first: int, steps: int) -> None:
    """``steps`` plain SGD steps from step ``first``, each rank on its slice of its data index's batch."""
    sp = engine.parallel_dims.sp
    where = engine.parallel_dims.coords(torch.distributed.get_rank())
    for step in range(first, first + steps):
        engine.backward(engine(*local_slice(step, where.data, where.seq, sp)))
        engine.step()


def resume_worker(rank: int, world: int, saved: tuple[int, int], loads: list[tuple[int, int]]) -> dict[str, Any]:
    """Train 2 SGD steps at ``saved`` (sequence degree, ZeRO stage), save; then, for each of ``loads``,
    load that checkpoint at its sequence degree and stage (data degree: the rest of the world) and train
    2 more steps.  Each resumed run's weights against one process's 4 steps: 2 at the saved data degree,
    2 at the loaded one."""
    where = [tempfile.mkdtemp(prefix="zeroshard-sp-checkpoint-") if rank == 0 else ""]
    torch.distributed.broadcast_object_list(where, src=0)
    directory = where[0]
    sp, stage = saved
    engine = zeroshard.initialize(model=model(), config=config(stage, "SGD", sp))[0]
    sgd_steps(engine, 0, 2)
    engine.save_checkpoint(directory)
    engine.close()
    worst = {}
    for sp, stage in loads:
        engine = zeroshard.initialize(model=model(), config=config(stage, "SGD", sp))[0]
        engine.load_checkpoint(directory)
        sgd_steps(engine, 2, 2)
        state = engine.full_state_dict(rank0_only=False)
        engine.close()
        expected, _ = reference("SGD", [world // saved[0]] * 2 + [world // sp] * 2)
        worst[f"sequence {sp}, stage {stage}"] = max(float((state[n] - v).abs().max()) / (float(v.abs().max()) or 1.0)
                                                     for n, v in expected.items())
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return worst


def check_resume(by_rank: list[dict[str, float]], saved: tuple[int, int], loads: list[tuple[int, int]]) -> None:
    for rank, worst in enumerate(by_rank):
        assert len(worst) == len(loads), worst
        for at, off in worst.items():
            assert off <= 1e-5, f"rank {rank}, loaded at {at}: the weights are off by {off:.2e}"


def ring_refusals(layer: DistributedAttention, heads: int) -> dict[str, str]:
    """What the ring refuses before any message: arguments for the local attention, and key/value heads
    that do not divide the query heads."""
    out = {}
    q = torch.zeros(1, 2, heads, 4)
    for name, call in {"arguments": lambda: layer(q, q, q, 0.5),
                       "heads": lambda: layer(q, *[torch.zeros(1, 2, heads + 1, 4)] * 2)}.items():
        try:
            call()
            out[name] = "accepted"
        except SequenceParallelError as err:
            out[name] = str(err)
    return out


def check_train(by_rank: list[dict[str, Any]], stage: int, optimizer: str, kv_heads: int = HEADS,
                heads: int = HEADS, mode: str = "ulysses", sp: int = SP, balanced: bool = False) -> None:
    world = len(by_rank)
    names = ("ring_kv",) if mode == "ring" else ("query", "key", "value", "context")
    for rank, result in enumerate(by_rank):
        assert result["worst"] <= 1e-5, f"rank {rank}: the weights are off by {result['worst']:.2e}"
        first = rank - rank % sp
        assert result["accessors"] == (sp, rank % sp, world, rank, list(range(first, first + sp))), \
            result["accessors"]
        assert result["train_batch_size"] == ROWS * world // sp  # the batch keys count data-parallel ranks
        assert result["after_close"] == 1, "a closed engine's sequence group still answers"
        labels = {label for label, _ in result["exchanges"]}
        assert labels == {f"sequence_{n}{g}" for n in names for g in ("", "_grad")}, labels
        assert {size for _, size in result["exchanges"]} == {sp}
        if mode == "ring":
            # a key/value block: ROWS x SEQ/sp positions x kv_heads x (key + value head_dim) fp32 values;
            # per layer and step the forward sends sp - 1 of them, the backward 2 (sp - 1) + 1
            block = ROWS * SEQ // sp * kv_heads * 2 * (D // HEADS) * 4
            assert result["sent"] == {"sequence_ring_kv": STEPS * LAYERS * (sp - 1) * block,
                                      "sequence_ring_kv_grad": STEPS * LAYERS * (2 * sp - 1) * block}, result["sent"]
        # the estimate's bytes per attention layer and micro-batch ([Note: sequence parallel estimates] in
        # planning/estimator.py) are what the ledger counted
        width = heads * (D // HEADS)
        request = EstimateRequest(num_params=1, world_size=world, precision="fp32", micro_batch=ROWS, seq_len=SEQ,
                                  shape=ModelShape(hidden=width, layers=LAYERS, heads=heads),
                                  sequence=SequenceShape(sp, mode, kv_heads))
        assert sum(result["sent"].values()) == STEPS * LAYERS * sequence_exchange_bytes(request), result["sent"]
        if mode == "ring":
            assert "cannot hand arguments to the local attention" in result["refused"]["arguments"], result
            assert f"{heads} query heads are not a multiple of {heads + 1}" in result["refused"]["heads"], result
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in by_rank) / world
        expected = by_rank[0]["expected_losses"][step]
        assert abs(mean - expected) <= 1e-5 * abs(expected), (step, mean, expected)


def refusals_worker(rank: int, world: int) -> dict[str, str]:
    """Each refusal's message, on every rank: a degree that does not divide the world, a sequence axis
    beside tensor parallelism (where the world has room for both), and query or key/value heads that do
    not split over the group, refused before any exchange (so no rank waits in one)."""
    out = {}
    attempts = {"degree": {"sequence_parallel_size": 3}}
    if world % (2 * SP) == 0:
        attempts["tensor"] = {"tensor_parallel": {"autotp_size": 2}}
    for name, extra in attempts.items():
        try:
            zeroshard.initialize(model=model(), config=config(0, "SGD", **extra))[0].close()
            out[name] = "accepted"
        except (SequenceParallelError, SequenceParallelSizeError) as err:
            out[name] = str(err)
    # slices of unequal length in one sequence group: refused before the forward's first exchange
    engine = zeroshard.initialize(model=model(), config=config(0, "SGD"))[0]
    length = SEQ // SP + (rank % SP)
    try:
        engine(*(torch.zeros(ROWS, length, dtype=torch.long),) * 3)
        out["uneven"] = "accepted"
    except SequenceParallelError as err:
        out["uneven"] = str(err)
    engine.close()
    group = torch.distributed.new_group(list(range(world)))
    # over a process group of the user's: an attention that works position by position and head by head
    # gives back exactly its local result, whatever the exchanges did in between
    elementwise = DistributedAttention(Elementwise(), group, scatter_idx=2, gather_idx=0)
    q, k, v = (torch.randn(3, 2, 2 * world, 4, generator=torch.Generator().manual_seed(10 * rank + i))
               for i in range(3))
    out["round trip"] = str(torch.equal(elementwise(q, k, v), q * k + v))
    layer = DistributedAttention(LocalAttention(), group, 2, 1)
    for name, (heads, kv_heads) in {"query heads": (3, 3), "key/value heads": (4, 3)}.items():
        try:
            layer(torch.zeros(1, 2, heads, 2), *[torch.zeros(1, 2, kv_heads, 2)] * 2)
            out[name] = "accepted"
        except SequenceParallelError as err:
            out[name] = str(err)
    return out


def check_refusals(by_rank: list[dict[str, str]]) -> None:
    world = len(by_rank)
    for result in by_rank:
        assert "sequence_parallel_size = 3 does not divide" in result["degree"], result
        if world % (2 * SP) == 0:
            assert "sequence_parallel_size = 2 with tensor parallelism is not supported yet" in result["tensor"]
        assert f"3 query heads (dimension 2 of (1, 2, 3, 2)) do not split over sequence_parallel_size {world}" \
            in result["query heads"], result
        assert "3 key heads" in result["key/value heads"], result
        assert "hold inputs of different shapes (the first tensor's: rank 0 of the group: (2, 4); rank 1 of " \
            "the group: (2, 5))" in result["uneven"], result
        assert result["round trip"] == "True", "the exchanges over a user's group do not invert each other"


def activations_worker(rank: int, world: int) -> dict[str, float]:
    """The bytes one measured forward leaves saved for backward on this rank (ZeRO-0, the same global
    sequences): at sequence 1 (each rank the whole sequences), at sequence 2 (half of them each), and at
    sequence 2 with each block checkpointed; no figure before ``measure_activations()``."""
    measured = {}
    for name, sp, checkpointed in (("sequence 1", 1, False), ("sequence 2", 2, False), ("checkpointed", 2, True)):
        net = model()
        if checkpointed:
            checkpoint_modules(net, Block)
        engine = zeroshard.initialize(model=net, config=config(0, "SGD", sp))[0]
        inputs = local_slice(0, 0, engine.parallel_dims.coords(rank).seq, sp)
        measured["unmeasured"] = float("activations" in engine.memory_breakdown())
        with engine.measure_activations():
            loss = engine(*inputs)
        engine.backward(loss)
        engine.step()
        measured[name] = engine.memory_breakdown()["activations"]
        engine.close()
    return measured


def check_activations(by_rank: list[dict[str, float]]) -> None:
    """Half the tokens, about half the activations (attention's saves are linear in the tokens here); far
    fewer with each block checkpointed."""
    for rank, measured in enumerate(by_rank):
        assert not measured["unmeasured"], f"rank {rank}: an activations entry before any measured forward"
        ratio = measured["sequence 2"] / measured["sequence 1"]
        assert 0.45 <= ratio <= 0.65, f"rank {rank}: sequence 2 holds {ratio:.3f} of sequence 1's activations"
        assert measured["checkpointed"] <= 0.5 * measured["sequence 2"], (rank, measured)


def loader_worker(rank: int, world: int) -> list[int]:
    """The first batch ``initialize(training_data=...)``'s loader hands this rank."""
    data = torch.utils.data.TensorDataset(torch.arange(4 * world))
    engine, _, loader, _ = zeroshard.initialize(model=model(), training_data=data, config=config(0, "SGD"))
    assert loader is not None
    (first,) = next(iter(loader))
    engine.close()
    return first.tolist()


def check_loader(by_rank: list[list[int]]) -> None:
    """The ranks of a sequence group take the same samples; the data-parallel indices, different ones."""
    world = len(by_rank)
    for rank, samples in enumerate(by_rank):
        assert len(samples) == ROWS and samples == by_rank[rank - rank % SP], by_rank
    firsts = [by_rank[d * SP] for d in range(world // SP)]
    assert len({tuple(s) for s in firsts}) == world // SP, by_rank


WORKERS = {"train": train_worker, "refusals": refusals_worker, "loader": loader_worker, "resume": resume_worker,
           "combined": combined_worker, "activations": activations_worker}
CHECKS = {"train": check_train, "refusals": check_refusals, "loader": check_loader, "resume": check_resume,
          "combined": check_combined, "activations": check_activations}


def cases(optimizers_at: dict[int, str], kv_heads: int, ring: list[dict[str, Any]],
          sp_only: bool = False) -> list[tuple[str, dict[str, Any]]]:
    trained = [("train", {"stage": stage, "optimizer": "SGD"}) for stage in range(4)]
    more = [("train", {"stage": stage, "optimizer": name}) for stage, name in optimizers_at.items()]
    gqa = [("train", {"stage": 2, "optimizer": "SGD", "kv_heads": kv_heads})]
    rings = [("train", {"optimizer": "SGD", "mode": "ring", **case}) for case in ring]
    combined = [("combined", {"case": case}) for case in COMBINED] + [("activations", {})] if sp_only else []
    return trained + more + gqa + rings + combined + [("refusals", {}), ("loader", {})]


def test_sequence_parallel_matches_one_process_at_sequence_2() -> None:
    """Sequence 2 x data 1: every stage with SGD, AdamW at stage 1, one key/value head (replicated); the
    ring at stages 0 and 3 with 3 heads (which degree 2 does not divide; head-tail sharding at stage 3),
    and at stage 1 with grouped key/value heads (4 query heads over 1); accumulation with clipping,
    activation checkpointing, offload and bf16."""
    family = cases({1: "AdamW"}, kv_heads=1, ring=[{"stage": 0, "heads": 3, "kv_heads": 3},
                                                   {"stage": 3, "heads": 3, "kv_heads": 3, "balanced": True},
                                                   {"stage": 1, "kv_heads": 1}], sp_only=True)
    check_family(family, run_family(SP, family, WORKERS), CHECKS, world=SP)


@pytest.mark.slow
def test_sequence_parallel_matches_one_process_at_sequence_2_data_2() -> None:
    """Sequence 2 x data 2: every stage with SGD, AdamW at stage 3, two key/value heads (one a rank); the
    ring at sequence 4 x data 1 with 2 heads, a degree above the head count, at stages 0 and 3 (head-tail
    sharding at stage 3); a checkpoint of sequence 2 x data 2 at stage 3 resumed at sequence 1 (stage 2)
    and 4 (stage 1)."""
    family = cases({3: "AdamW"}, kv_heads=2, ring=[{"stage": stage, "heads": 2, "kv_heads": 2, "sp": 2 * SP,
                                                    "balanced": stage == 3} for stage in (0, 3)])
    family.append(("resume", {"saved": (SP, 3), "loads": [(1, 2), (2 * SP, 1)]}))
    check_family(family, run_family(2 * SP, family, WORKERS), CHECKS, world=2 * SP)


ULYSSES_SCRIPT = Path(__file__).parent / "ds_scripts" / "ulysses_ds_style.py"


@pytest.mark.slow  # extended (a launcher run): runs in CI (see conftest.py)
def test_a_deepspeed_ulysses_script_trains_unmodified_under_zeroshard_run_as_deepspeed(tmp_path: Path) -> None:
    """ds_scripts/ulysses_ds_style.py (``import deepspeed``, ``deepspeed.sequence.layer.DistributedAttention``,
    ``deepspeed.utils.groups``, ``sequence_parallel_size`` 2) at ZeRO-2 with plain SGD equals the same script's
    one-process reference on the whole sequences: losses (the mean of the two slices') and weights."""
    g = torch.Generator().manual_seed(5)
    torch.save(tuple(torch.randint(0, 31, (STEPS, ROWS, SEQ), generator=g) for _ in range(2)), tmp_path / "data.pt")
    lr = 0.5
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": ROWS, "sequence_parallel_size": 2, "steps_per_print": 1000,
        "zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": lr}}}))
    common = [str(ULYSSES_SCRIPT), "--deepspeed_config", str(tmp_path / "ds.json"), "--data", str(tmp_path / "data.pt")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "run", "--as-deepspeed", "--num_gpus", "2",
                           "--master_port", str(free_port()), *common, "--out", str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    runner = ("import runpy, sys, zeroshard; zeroshard.install_as_deepspeed(); sys.argv = sys.argv[1:]; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")
    ref = subprocess.run([sys.executable, "-c", runner, *common, "--reference", str(lr), "--out",
                          str(tmp_path / "ref.json")], capture_output=True, text=True, timeout=300, env=env)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-6000:]
    got, want = (json.loads((tmp_path / name).read_text()) for name in ("out.json", "ref.json"))
    assert got["sequence_world"] == 2
    for step, expected in enumerate(want["losses"]):
        mean = sum(losses[step] for losses in got["losses"]) / 2
        assert abs(mean - expected) <= 1e-5 * abs(expected), (step, mean, expected)
    for name, expected in want["weights"].items():
        e, w = torch.tensor(expected), torch.tensor(got["weights"][name])
        assert float((w - e).abs().max()) <= 1e-5 * float(e.abs().max()), name
