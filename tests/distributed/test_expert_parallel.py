"""Expert parallelism: MoE layers with ``ep_size`` > 1 train like one process holding every expert.

One world of four ranks, told they are two nodes of two, runs every case: ep 2 x data 2 and ep 4 x data
1, ZeRO stages 0-3, top-1 and top-2, with and without token dropping. The oracle is one process with
``ep_size=1`` (all four experts) that routes each rank's batch itself (routing, capacity and l_aux are
per rank) and averages the four losses (fp32, 1e-5 relative). Each expert starts from values of its own
(set by its global index), so an expert mixed up with another is caught. Beside the values: each rank's
``l_aux`` and ``exp_counts`` equal the oracle's, every expert bucket's reduction and gather run over the
ranks holding the same experts only (the collectives' log), and the experts' state is split over those
ranks only. In bf16 (stage 2, ep 2) the distance to the fp32 oracle is bf16's own, as large as with every
expert on every rank.

With ZeRO++ (ep 2: stage 3 with qwZ and 4-bit qgZ, stage 2 with 8-bit qgZ) each experts' bucket is
gathered and reduced over the two ranks holding its experts (one on each node: the hop across nodes only),
each collective moving exactly its blocks' payload and scales; the weights stay finite and within half
of the distance training moved them from the oracle's, each loss within 3% of the unquantised run's.

The same world then saves a checkpoint at ep 2 x data 2, ZeRO-2, and loads it at ep 1 x data 4 ZeRO-3,
ep 4 ZeRO-1 and ep 2 ZeRO-0: the loaded weights equal the saved ones bitwise (under the global names of
the model with every expert), one more step equals the oracle's, and ``zeroshard consolidate``'s
weights load into the one-process model.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.experts import MoE
from zeroshard.deepspeed.utils import groups as ds_groups
from zeroshard.deepspeed.utils.tensor_fragment import safe_get_full_fp32_param
from zeroshard.experts.groups import ExpertParallelError
from zeroshard.moe.utils import split_params_into_different_moe_groups_for_optimizer
from zeroshard.quantize import BlockFormat, packed_bytes
from zeroshard.tools.testing import CaseFailures, case, run_world

VOCAB, WIDTH, ROWS, STEPS, LR, AUX, EXPERTS, WORLD, PER_NODE = 16, 8, 12, 5, 1e-2, 0.01, 4, 4, 2
EXPERT_PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."

# (stage, ep_size, k, drop_tokens)
CASES = [(0, 2, 2, True), (1, 2, 1, False), (2, 2, 2, False), (3, 2, 2, True), (2, 4, 1, True), (0, 4, 2, False),
         (1, 4, 2, True), (3, 4, 1, False)]


class MoEModel(nn.Module):
    def __init__(self, ep_size: int, k: int, drop_tokens: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.moe = MoE(WIDTH, nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH)),
                       num_experts=EXPERTS, ep_size=ep_size, k=k, capacity_factor=1.0, min_capacity=2,
                       use_rts=False, drop_tokens=drop_tokens, top2_2nd_expert_sampling=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        out, l_aux, counts = self.moe(h)
        self.seen = (float(l_aux.detach()), counts.tolist())
        return nn.functional.cross_entropy(self.head(torch.tanh(h + out)), y) + AUX * l_aux


def global_name(local: str, ep_rank: int, local_experts: int) -> str:
    """An expert parameter's name in the one-process model (its global expert index)."""
    if not local.startswith(EXPERT_PREFIX):
        return local
    index, rest = local[len(EXPERT_PREFIX):].split(".", 1)
    return f"{EXPERT_PREFIX}{ep_rank * local_experts + int(index)}.{rest}"


def reference_model(k: int, drop_tokens: bool) -> MoEModel:
    torch.manual_seed(0)
    model = MoEModel(1, k, drop_tokens)
    with torch.no_grad():
        for i, expert in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
            for p in expert.parameters():
                p.add_(0.1 * (i + 1))  # every expert its own values
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (ROWS,), generator=g), torch.randint(0, VOCAB, (ROWS,), generator=g)


def groups(model: nn.Module) -> list[dict]:
    return split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "weight_decay": 0.0})


def reference(k: int, drop_tokens: bool, steps: int = STEPS) -> tuple[dict[str, torch.Tensor], list[list[Any]]]:
    model = reference_model(k, drop_tokens)
    opt = torch.optim.AdamW(groups(model), lr=LR, weight_decay=0.0)
    seen = []
    for step in range(steps):
        losses = []
        for r in range(WORLD):
            losses.append(model(*batch(step, r)))
            seen.append(model.seen)
        (sum(losses) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, seen


def engine_for(rank: int, stage: int, ep: int, k: int, drop_tokens: bool,
               extra: Optional[dict[str, Any]] = None, zero: Optional[dict[str, Any]] = None) -> tuple[Any, MoEModel]:
    local = EXPERTS // ep
    ep_rank = rank % ep
    model = MoEModel(ep, k, drop_tokens)
    start = reference_model(k, drop_tokens).state_dict()
    model.load_state_dict({name: start[global_name(name, ep_rank, local)] for name in model.state_dict()})
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=groups(model), config={
        "train_micro_batch_size_per_gpu": ROWS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0,
                              **(zero or {})},
        "collective_timeout": 60, **(extra or {})})
    return engine, model


def trained(rank: int, stage: int, ep: int, k: int, drop_tokens: bool,
            extra: Optional[dict[str, Any]] = None, zero: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    engine, model = engine_for(rank, stage, ep, k, drop_tokens, extra, zero)
    log = engine.comm.ledger.start_log()
    seen, losses = [], []
    for step in range(STEPS):
        loss = engine(*batch(step, rank))
        engine.backward(loss)
        seen.append(model.seen)
        losses.append(float(loss.detach()))
        engine.step()
    name = f"ep_size_{ep}"
    accessors = () if ep == 1 else (ds_groups._get_expert_parallel_world_size(name), ds_groups._get_expert_parallel_rank(name),
                 ds_groups._get_expert_data_parallel_world_size(name), ds_groups._get_expert_data_parallel_rank(name),
                 ds_groups._get_expert_broadcast_src_rank(name), ds_groups._get_data_parallel_world_size())
    memory = {k: v for k, v in engine.memory_breakdown().items()
              if k in ("model_states", "formula", "expert_model_states", "expert_formula")}
    experts = {b.index: b.world_size for b in engine.strategy.layout.buckets if b.experts}
    dense = {b.index: b.world_size for b in engine.strategy.layout.buckets if not b.experts}
    grads = {(r.label, r.group_size) for r in log if r.label.startswith(("grad_bucket", "param_bucket"))}
    state = engine.full_state_dict(rank0_only=False)  # every expert, under its global name
    # DeepSpeed's fragment API: an expert's fp32 value from the ranks that hold that expert
    fragments = {global_name(n, rank % ep, EXPERTS // ep): safe_get_full_fp32_param(p)
                 for n, p in model.named_parameters() if p.requires_grad}
    fragments_equal = extra is not None or all(torch.equal(v, state[n]) for n, v in fragments.items())
    owned = engine.strategy.owned_real_numel()
    shards = {b.index: b.shard_numel for b in engine.strategy.layout.buckets}
    quantised = [(r.kind.name, r.label, r.group_size, r.scope.name, r.sent) for r in log
                 if r.label.endswith((".qgz", ".qwz"))]
    engine.close()
    return {"state": state, "seen": seen, "experts": experts, "dense": dense, "grads": sorted(grads),
            "owned": owned, "accessors": accessors, "memory": memory, "fragments_equal": fragments_equal,
            "losses": losses, "shards": shards, "quantised": quantised}


def relative(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert set(ours) == set(expected), sorted(set(ours) ^ set(expected))
    return max(float((ours[name] - v).abs().max()) / (float(v.abs().max()) or 1.0) for name, v in expected.items())


BLOCK = 16
#: ZeRO++ at ep 2 x data 2 (top-2, dropping): (stage, zero_optimization keys); the unquantised run is CASES[3]
ZEROPP = [(3, {"zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_quantized_block_size": BLOCK}),
          (2, {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 8,
               "zero_quantized_block_size": BLOCK})]


def moved_off(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """How far ``ours`` is from ``expected`` as a fraction of how far training moved ``expected`` (Adam moves
    an element by about lr whatever the size of its gradient, so a relative distance says little)."""
    start = reference_model(2, True).state_dict()
    off = sum(float((ours[n].float() - v).pow(2).sum()) for n, v in expected.items())
    return (off / sum(float((v - start[n]).pow(2).sum()) for n, v in expected.items())) ** 0.5


def check_zeropp(result: dict[str, Any], zero: dict[str, Any], plain_losses: list[float]) -> None:
    """qwZ's gathers and qgZ's hops over the right group each, with quantised bytes; close to unquantised."""
    assert result["fragments_equal"] and result["off"] <= 0.5, result["off"]
    assert all(abs(q - p) <= 0.03 * p for q, p in zip(result["losses"], plain_losses)), result["losses"]
    hops: dict[str, list[tuple[str, int, int]]] = {}
    for kind, label, size, scope, sent in result["quantised"]:
        if kind == "ALL_TO_ALL":
            hops.setdefault(label, []).append((scope, size, sent))
        else:  # qwZ: each rank's int8 chunk and its scales, over the bucket's own group
            experts = label.startswith("gather[moe.deepspeed_moe.experts")
            shard = next(result["shards"][i] for i in (result["experts"] if experts else result["dense"]))
            assert size == (WORLD // 2 if experts else WORLD)
            assert sent == (size - 1) * packed_bytes(shard, BlockFormat(8, BLOCK))
    assert bool(hops) == zero.get("zero_quantized_gradients", False)
    fmt = BlockFormat(zero.get("zero_quantized_gradients_bits", 4), BLOCK)
    for index, shard in result["shards"].items():
        if index in result["experts"]:  # ranks 0 and 2 (1 and 3) hold the same experts, one on each node
            expected = [("ACROSS_NODES", 2, packed_bytes(shard, fmt))]
        else:  # two nodes of two: inside, then across
            expected = [("INSIDE_NODE", 2, packed_bytes(2 * shard, fmt)), ("ACROSS_NODES", 2, packed_bytes(shard, fmt))]
        assert hops[f"grad_bucket{index}.qgz"] == expected * (len(hops[f"grad_bucket{index}.qgz"]) // len(expected))


# saved at (stage, ep); loaded at each of LOADS
SAVED, LOADS = (2, 2), [(3, 1), (1, 4), (0, 2)]


def reshapes(rank: int, directory: str) -> list[dict[str, Any]]:
    """Save at SAVED, load at each of LOADS (bitwise), step once more (the oracle's next step)."""
    k, drop = 2, True
    engine, _ = engine_for(rank, *SAVED, k, drop)
    for step in range(STEPS):
        engine.backward(engine(*batch(step, rank)))
        engine.step()
    engine.save_checkpoint(directory, tag="ep")
    saved = engine.full_state_dict(rank0_only=False)
    engine.close()
    after, _ = reference(k, drop, STEPS + 1)
    out = []
    for stage, ep in LOADS:
        with case(saved=SAVED, loaded=(stage, ep), rank=rank):
            engine, _ = engine_for(rank, stage, ep, k, drop)
            engine.load_checkpoint(directory, tag="ep")
            loaded = engine.full_state_dict(rank0_only=False)
            bitwise = all(torch.equal(loaded[n], v) for n, v in saved.items()) and set(loaded) == set(saved)
            engine.backward(engine(*batch(STEPS, rank)))
            engine.step()
            out.append({"bitwise": bitwise, "next": relative(engine.full_state_dict(rank0_only=False), after)})
            engine.close()
    # an ep_size that does not divide the world: a named error on every rank, before any exchange
    odd = nn.ModuleDict({"moe": MoE(WIDTH, nn.Linear(WIDTH, WIDTH), num_experts=3, ep_size=3)})
    try:
        zeroshard.initialize(model=odd, config={"train_micro_batch_size_per_gpu": 1, "collective_timeout": 60,
                                                "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        out.append({"refused": "accepted"})
    except ExpertParallelError as err:
        out.append({"refused": str(err)})
    if rank == 0:
        from zeroshard.checkpoint.consolidate import full_state_dict as consolidated
        plain = MoEModel(1, k, drop)
        plain.load_state_dict(consolidated(directory, "ep"))  # strict: every expert, no other name
        out.append({"consolidated": all(torch.equal(v, saved[n]) for n, v in plain.state_dict().items())})
    return out


def worker(rank: int, world: int, directory: str) -> list[dict[str, Any]]:
    out = []
    references: dict[tuple[int, bool], Any] = {}
    for stage, ep, k, drop in CASES:
        with case(stage=stage, ep=ep, k=k, drop_tokens=drop, rank=rank):
            if (k, drop) not in references:
                references[(k, drop)] = reference(k, drop)
            expected, seen = references[(k, drop)]
            ours = trained(rank, stage, ep, k, drop)
            worst = max(float((ours["state"][name] - v).abs().max()) / (float(v.abs().max()) or 1.0)
                        for name, v in expected.items() if name in ours["state"])
            out.append({"worst": worst, "seen": ours["seen"], "losses": ours["losses"],
                        "expected_seen": [seen[s * WORLD + rank] for s in range(STEPS)],
                        "experts": ours["experts"], "dense": ours["dense"], "grads": ours["grads"],
                        "owned": ours["owned"], "accessors": ours["accessors"], "memory": ours["memory"],
                        "fragments_equal": ours["fragments_equal"]})
    with case(stage=2, ep=2, precision="bf16", rank=rank):  # fp32 masters of each rank's own chunks
        expected, _ = references[(2, True)]
        worst = [relative({n: v.float() for n, v in trained(rank, 2, ep, 2, True, {"bf16": {"enabled": True}})
                           ["state"].items()}, expected) for ep in (1, 2)]
        out.append({"bf16": worst})
    zeropp = []
    for stage, zero in ZEROPP:
        with case(stage=stage, ep=2, zeropp=zero, rank=rank):
            ours = trained(rank, stage, 2, 2, True, zero=zero)
            assert all(torch.isfinite(v).all() for v in ours["state"].values())
            zeropp.append({**ours, "state": None, "off": moved_off(ours["state"], references[(2, True)][0])})
    return [out, reshapes(rank, directory), zeropp]


def test_expert_parallel_trains_like_one_process(tmp_path: Any) -> None:
    by_rank = run_world(worker, WORLD, args=(str(tmp_path / "ckpt"),), timeout=600, ranks_per_node=PER_NODE)
    failures = CaseFailures()
    for i, (stage, ep, k, drop) in enumerate(CASES):
        with failures.case(stage=stage, ep=ep, k=k, drop_tokens=drop, memory="summed over ranks"):
            # every expert's state is held once per data-parallel replica of it, the dense state once per
            # rank: summed over the ranks the holdings are N times each part's per-rank formula
            memory = [results[i]["memory"] for results, *_ in by_rank]
            for held, formula in (("model_states", "formula"), ("expert_model_states", "expert_formula")):
                assert sum(m[held] for m in memory) == pytest.approx(WORLD * memory[0][formula], rel=0, abs=1e-6)
    for rank, (results, loads, zeropp) in enumerate(by_rank):
        for i, (stage, zero) in enumerate(ZEROPP):
            with failures.case(stage=stage, ep=2, zeropp=zero, rank=rank):
                check_zeropp(zeropp[i], zero, results[CASES.index((3, 2, 2, True))]["losses"])
                first, last = (sum(by_rank[r][2][i]["losses"][s] for r in range(WORLD)) for s in (0, STEPS - 1))
                assert last < 0.95 * first, "the ranks' mean loss does not fall"
        with failures.case(stage=2, ep=2, precision="bf16", rank=rank):
            # bf16's own rounding, as large with every expert on every rank: expert parallelism adds none
            data_parallel, spread = results[-1]["bf16"]
            assert spread <= 1.5 * data_parallel and data_parallel <= 0.1, (data_parallel, spread)
        for (stage, ep), result in zip(LOADS, loads):
            with failures.case(saved=SAVED, loaded=(stage, ep), rank=rank):
                assert result["bitwise"], "the loaded weights differ from the saved ones"
                assert result["next"] <= 1e-5, f"the step after the load is off by {result['next']:.2e}"
        with failures.case(refused="ep_size 3 at world 4", rank=rank):
            assert "does not divide the data-parallel world of 4" in loads[len(LOADS)]["refused"]
        if rank == 0:
            with failures.case(consolidated=SAVED):
                assert loads[-1]["consolidated"], "consolidate's weights differ from the saved ones"
        for (stage, ep, k, drop), result in zip(CASES, results):
            with failures.case(stage=stage, ep=ep, k=k, drop_tokens=drop, rank=rank):
                assert result["worst"] <= 1e-5, f"off by {result['worst']:.2e}"
                assert result["fragments_equal"], "safe_get_full_fp32_param differs from the trained weights"
                assert result["accessors"] == (ep, rank % ep, WORLD // ep, rank // ep, rank % ep, WORLD)
                for (ours_aux, ours_counts), (aux, counts) in zip(result["seen"], result["expected_seen"]):
                    assert ours_counts == counts and abs(ours_aux - aux) <= 1e-6 * max(1.0, abs(aux))
                assert result["experts"] and all(size == WORLD // ep for size in result["experts"].values())
                assert all(size == WORLD for size in result["dense"].values())
                by_label = dict(result["grads"])
                for index, size in {**result["experts"], **result["dense"]}.items():
                    assert by_label.get(f"grad_bucket{index}") == size, (index, result["grads"])
    failures.raise_any()
