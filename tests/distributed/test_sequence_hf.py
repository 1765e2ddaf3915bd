"""Sequence parallelism on the Hugging Face path (DeepSpeed's ALST) trains like one process on the whole sequences.

A transformers ``LlamaForCausalLM`` (2 layers, 4 query heads over 2 key/value heads, fp32, sdpa) trains 3
steps with ``UlyssesSPAttentionHF.register_with_transformers`` wrapping its attention, the unit it returns
passed as ``initialize(mpu=...)``, and each rank's batches cut by ``UlyssesSPDataLoaderAdapter``: rank r
of the group draws batches r, r + P, ... and the adapter hands the group each of them in turn ([Note: the
adapter's order of batches] in zeroshard/sequence/loader.py), so step i trains on batch i, whose sequence
length differs from the last one's.  The labels hold -100 at uneven places: scattered, and a prompt that
leaves one rank's slice of a batch no counted token at all.  The loss is ``sequence_loss`` (the mean over
the group's counted tokens, [Note: a loss over the group's counted tokens] in zeroshard/sequence/loss.py),
or DeepSpeed's tutorial's weighted all-gather where every slice counts a token.  The oracle is one process
on the whole sequences with transformers' own loss: plain SGD (not scale-invariant, so a gradient off by
the sequence degree shows) at ZeRO stages 0-3, AdamW with clipping active at stage 3 (and 2), and with
each layer's MLP through ``TiledMLP`` and the logits and loss through ``sequence_tiled_compute``
(zeroshard/sequence/tiled.py) at stage 3 (and 2); losses, gradient norms and
weights equal it (fp32, 1e-5 relative).  Refused by name on every rank: heads the
degree does not split, eager attention, a batch without position ids, a length the degree does not split.
Accelerate's ``ParallelismConfig(sp_size=2, sp_backend="deepspeed")`` (through ``install_as_deepspeed()``:
its DeepSpeed version check, the registration, the unit into ``initialize``, its loader adapted) trains the
same model equal to one process, as the family's first case.  The ring (the config's
``sequence_parallel.mode: "ring"``, with and without ``load_balance``'s head-tail sharding) trains the same
way, the adapter's slices checked against ``sequence_positions``, and with transformers' activation
checkpointing (each layer's ring run again in the backward), as Ulysses does; bf16 within its tolerance
of the fp32 oracle.  AdamW's learning rate is small and its eps
1e-6: its per-element normalisation turns the fp32 rounding of gradient elements that nearly cancel
(which the ring's block-by-block softmax rounds otherwise than one attention over the whole sequence)
into weight differences in proportion to the learning rate, and to 1 / eps where they are near zero.

The default suite runs the world of two (sequence 2 x data 1); the world of four (sequence 4 x data 1,
two key/value heads repeated over four ranks, the ring with 2 heads and in bf16 too, and sequence 2 x
data 2, where the oracle is the mean of the two data indices' losses, each over its own batch's counted
tokens) is an extended test, and so is
DeepSpeed's ALST tutorial's script (ds_scripts/alst_tutorial.py), unmodified under ``zeroshard run
--as-deepspeed`` at ZeRO-0 with plain SGD, equal to one process training each sample as often as the
tutorial's adapter hands it out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from zeroshard.tools.testing import check_family, free_port, run_family

V, HIDDEN, HEADS, KV_HEADS, LAYERS, ROWS, STEPS = 128, 32, 4, 2, 2, 2, 3
LENGTHS = (16, 24, 32, 16)  # batch i's sequence length
OPTIMIZERS = {"SGD": {"type": "SGD", "params": {"lr": 0.5}},
              "AdamW": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1, "eps": 1e-6}}}
CLIP = 0.05  # below every step's norm: clipping acts at every step


def llama(heads: int = HEADS, attention: str = "sdpa") -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=heads, num_key_value_heads=KV_HEADS if heads % KV_HEADS == 0 else heads,
                         max_position_embeddings=64, attn_implementation=attention)
    return LlamaForCausalLM(config).float()


def sample(index: int, every_slice_counts: bool = False, data: int = 0) -> dict[str, torch.Tensor]:
    """Batch ``index`` of data-parallel index ``data``: its own length, -100 scattered and over a prompt;
    with ``every_slice_counts`` the prompt is short, otherwise batch 2's covers the first half of its labels
    (the first slices count none)."""
    g = torch.Generator().manual_seed(index + 1000 * data)
    length = LENGTHS[index]
    ids = torch.randint(0, V, (ROWS, length), generator=g)
    labels = ids.clone()
    labels[torch.rand(ROWS, length, generator=g) < 0.3] = -100
    prompt = (3, 5, 3, 0)[index] if every_slice_counts else (3, 13, length // 2 + 1, 0)[index]
    labels[:, :prompt] = -100
    return {"input_ids": ids, "position_ids": torch.arange(length).expand(ROWS, -1), "labels": labels}


def reference(optimizer: str, clip: float, every_slice_counts: bool, dp: int = 1, heads: int = HEADS
              ) -> dict[str, Any]:
    """One process on the whole sequences, transformers' own attention and loss; with ``dp`` data-parallel
    indices, the mean of their losses (each its own batch's mean, as data parallelism averages them)."""
    net = llama(heads)
    spec = OPTIMIZERS[optimizer]
    opt = getattr(torch.optim, spec["type"])(net.parameters(), **spec["params"])
    losses, norms = [], []
    for step in range(STEPS):
        loss = sum(net(**sample(step, every_slice_counts, data)).loss for data in range(dp)) / dp
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip if clip else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"state": {k: v.detach().clone() for k, v in net.state_dict().items()}, "losses": losses, "norms": norms}


def config(stage: int, optimizer: str, clip: float, sp: int, mode: str = "ulysses") -> dict[str, Any]:
    extra: dict[str, Any] = {"sequence_parallel_size": sp} if sp else {}  # 0: the degree comes from the unit alone
    if mode != "ulysses":  # "ring", or "balanced": the ring with head-tail sharding
        extra["sequence_parallel"] = {"mode": "ring", "load_balance": mode == "balanced"}
    return {"train_micro_batch_size_per_gpu": ROWS, "collective_timeout": 60, "gradient_clipping": clip,
            "optimizer": OPTIMIZERS[optimizer], **extra,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0}}


def tutorial_loss(outputs: Any, model: Any, shift_labels: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """DeepSpeed's tutorial's loss: each slice's mean, weighted by its counted tokens through a
    differentiable all-gather."""
    loss = model.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                               vocab_size=model.config.vocab_size)
    losses = torch.distributed.nn.functional.all_gather(loss, group=group)
    good = (shift_labels != -100).view(-1).sum()
    goods = torch.distributed.nn.functional.all_gather(good, group=group)
    return sum(losses[r] * goods[r] for r in range(size)) / max(sum(goods), 1)


def tiled_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """LlamaMLP's forward through ``TiledMLP`` in 3 tiles (uneven where 3 does not divide the slice), as
    DeepSpeed's tutorial patches it (with ``tiled``, the logits and loss are tiled too: ``TiledLoss``)."""
    from zeroshard.sequence import TiledMLP

    def mlp(module: Any, part: torch.Tensor) -> torch.Tensor:
        return module.down_proj(module.act_fn(module.gate_proj(part)) * module.up_proj(part))

    return TiledMLP.apply(mlp, self, x, 3, [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight])


class TiledLoss(torch.nn.Module):
    """The causal LM with its logits and loss computed 3 tiles at a time (``sequence_tiled_compute``): no
    rank holds its whole slice's logits; the loss is the mean over the group's counted tokens."""

    def __init__(self, llama: Any) -> None:
        super().__init__()
        self.llama = llama

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        from zeroshard.sequence import combine_sequence_losses, sequence_tiled_compute

        hidden = self.llama.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state

        def loss_sum(hidden_states: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
            logits = self.llama.lm_head(hidden_states).float()
            return torch.nn.functional.cross_entropy(logits.reshape(-1, V), shift_labels.reshape(-1),
                                                     ignore_index=-100, reduction="sum")

        total = sequence_tiled_compute(loss_sum, hidden.shape[1], 3, {"hidden_states": hidden,
                                                                      "shift_labels": shift_labels},
                                       {}, "hidden_states", output_unshard_dimension=0, output_reduction="sum")
        return combine_sequence_losses(total, (shift_labels != -100).sum())


def train_worker(rank: int, world: int, stage: int, optimizer: str, clip: float = 0.0, loss: str = "zeroshard",
                 config_sp: bool = True, tiled: bool = False, sp: int = 0, mode: str = "ulysses", heads: int = HEADS,
                 checkpointing: bool = False, bf16: bool = False) -> dict[str, Any]:
    """``sp`` ranks (0: the world) split each sequence; the rest of the world is data-parallel.  ``mode``:
    ``ulysses``, ``ring`` or ``balanced`` (the ring with head-tail sharding), the config's choice;
    ``checkpointing``: transformers' activation checkpointing, every layer's forward (its attention's
    exchanges too) run again in the backward; ``bf16``: the engine trains in bf16 (the oracle stays fp32)."""
    import zeroshard
    from zeroshard.deepspeed.utils import groups
    from zeroshard.sequence.hf import UlyssesSPAttentionHF, restore_transformers_attention
    from zeroshard.sequence.loader import UlyssesSPDataLoaderAdapter
    from zeroshard.sequence.loss import sequence_loss

    every_slice_counts = loss == "tutorial"
    restore_transformers_attention("sdpa")
    sp = sp or world
    expected = reference(optimizer, clip, every_slice_counts, world // sp, heads)
    model = llama(heads)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if tiled:
        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(tiled_mlp_forward, layer.mlp)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=sp, micro_batch_size=ROWS)
    settings = config(stage, optimizer, clip, sp if config_sp else 0, mode)
    if bf16:
        settings["bf16"] = {"enabled": True}
    engine = zeroshard.initialize(model=TiledLoss(model) if tiled else model, mpu=mpu, config=settings)[0]
    log = engine.comm.ledger.start_log()
    group, size, sp_rank = (groups._get_sequence_parallel_group(), groups._get_sequence_parallel_world_size(),
                            groups._get_sequence_parallel_rank())
    data = rank // size
    mine = [sample(i, every_slice_counts, data) for i in range(sp_rank, len(LENGTHS), size)]
    drawn = torch.utils.data.DataLoader(mine, batch_size=None)
    loader = UlyssesSPDataLoaderAdapter(drawn, sp_rank=sp_rank, sp_group=group, sp_world_size=size,
                                        device=engine.device)
    losses, norms, counted, positions = [], [], [], []
    for _, batch in zip(range(STEPS), loader):
        labels = batch["shift_labels"]
        positions.append(batch["position_ids"][0].tolist())
        counted.append(int((labels != -100).sum()))
        if tiled:
            value = engine(**batch)
        else:
            outputs = engine(**batch)
            value = sequence_loss(outputs.logits, labels) if loss == "zeroshard" \
                else tutorial_loss(outputs, engine.module, labels, group, size)
        engine.backward(value)
        engine.step()
        losses.append(float(value.detach()))
        norms.append(engine.get_global_grad_norm())
    state = {name.removeprefix("llama."): value for name, value in engine.full_state_dict(rank0_only=False).items()}
    worst, worst_name = max((float((state[n].float() - v).abs().max()) / (float(v.abs().max()) or 1.0), n)
                            for n, v in expected["state"].items())
    labels_sent = sorted({r.label for r in log if r.label.startswith("sequence_")})
    engine.close()
    restore_transformers_attention("sdpa")
    return {"worst": worst, "worst_name": worst_name, "losses": losses, "norms": norms,
            "expected": {k: expected[k] for k in ("losses", "norms")},
            "counted": counted, "length": len(loader), "labels": labels_sent, "sp": (size, sp_rank, mpu.ranks()),
            "positions": positions}


def check_train(by_rank: list[dict[str, Any]], stage: int, optimizer: str, clip: float = 0.0, loss: str = "zeroshard",
                config_sp: bool = True, tiled: bool = False, sp: int = 0, mode: str = "ulysses", heads: int = HEADS,
                checkpointing: bool = False, bf16: bool = False) -> None:
    from zeroshard.sequence import sequence_positions

    world, tolerance = len(by_rank), 2e-2 if bf16 else 1e-5
    sp = sp or world
    exchanged = {"sequence_query", "sequence_key", "sequence_value", "sequence_context", "sequence_position_ids"} \
        if mode == "ulysses" else {"sequence_ring_kv", "sequence_ring_kv_grad"}
    for step, want in enumerate(by_rank[0]["expected"]["losses"]):  # each group's loss: its data index's mean
        got = sum(r["losses"][step] for r in by_rank) / world
        assert abs(got - want) <= tolerance * abs(want), ("losses", step, got, want)
    for rank, result in enumerate(by_rank):
        assert result["worst"] <= tolerance, f"rank {rank}: {result['worst_name']} is off by {result['worst']:.2e}"
        assert result["losses"] == by_rank[rank - rank % sp]["losses"], "a sequence group's ranks differ in loss"
        for step, (got, want) in enumerate(zip(result["norms"], result["expected"]["norms"])):
            assert abs(got - want) <= tolerance * abs(want), (rank, "norms", step, got, want)
        first = rank - rank % sp
        assert result["sp"] == (sp, rank % sp, list(range(first, first + sp))), result["sp"]
        assert result["length"] == sp * len(range(rank % sp, len(LENGTHS), sp)), result["length"]
        assert exchanged | {"sequence_batch"} <= set(result["labels"]), result["labels"]
        assert not {"sequence_query", "sequence_ring_kv"} - exchanged & set(result["labels"]), result["labels"]
        for step, held in enumerate(result["positions"]):  # the adapter cuts as the attention computes
            assert held == sequence_positions(LENGTHS[step], rank % sp, sp, mode == "balanced").tolist(), held
        if loss == "zeroshard":
            assert "sequence_loss" in result["labels"], result["labels"]
    counted = [r["counted"] for r in by_rank]
    if loss == "tutorial":
        assert all(min(c) > 0 for c in counted), counted
    elif mode != "balanced":  # the first slices of batch 2 count no token (head-tail chunks each hold some)
        assert counted[0][2] == 0 and sum(c[2] for c in counted) > 0, counted


def refusals_worker(rank: int, world: int) -> dict[str, str]:
    """Each refusal's message, on every rank."""
    from zeroshard.sequence.groups import SequenceParallelError
    from zeroshard.sequence.hf import UlyssesSPAttentionHF, restore_transformers_attention
    from zeroshard.sequence.loader import UlyssesSPDataLoaderAdapter
    from zeroshard.sequence.unit import sequence_parallel_unit

    out = {}
    unit = sequence_parallel_unit(world)
    no_positions = {k: v for k, v in sample(rank).items() if k != "position_ids"} if rank == world - 1 else sample(rank)
    odd = {k: v[:, :15] for k, v in sample(0).items()}
    attempts = {
        "heads": lambda: one_head_forward(world),
        "eager": lambda: UlyssesSPAttentionHF.register_with_transformers(llama(attention="eager"), "eager", world,
                                                                         ROWS),
        "positions": lambda: next(UlyssesSPDataLoaderAdapter([no_positions], rank, unit.get_sequence_parallel_group(),
                                                              world, "cpu")),
        "length": lambda: next(UlyssesSPDataLoaderAdapter([odd], rank, unit.get_sequence_parallel_group(), world,
                                                          "cpu")),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "accepted"
        except SequenceParallelError as err:
            out[name] = str(err)
    restore_transformers_attention("sdpa")
    return out


def one_head_forward(world: int) -> None:
    """A model of one head registered (the mode is not known before the engine), then its attention called
    under Ulysses (no engine: the group's default), which cannot split the head."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from zeroshard.sequence.hf import UlyssesSPAttentionHF

    model = llama(heads=1)
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, ROWS)
    query = torch.zeros(ROWS, 1, 8, HIDDEN)
    ALL_ATTENTION_FUNCTIONS["sdpa"](model.model.layers[0].self_attn, query, query, query, None,
                                    position_ids=torch.arange(8).expand(ROWS, -1))


def check_refusals(by_rank: list[dict[str, str]]) -> None:
    world = len(by_rank)
    for result in by_rank:
        assert f"1 attention heads do not split over sequence_parallel_size {world}" in result["heads"], result
        assert "'eager' attention needs a mask of the whole sequence" in result["eager"], result
        assert f"rank {world - 1} of the group drew a batch without position_ids" in result["positions"], result
        assert f"sequence length 15, which does not split over sequence_parallel_size {world}" in result["length"]


def accelerate_worker(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Accelerate's ``ParallelismConfig(sp_size=world, sp_backend="deepspeed")`` with a DeepSpeed plugin, as
    its users write it, through ``install_as_deepspeed()`` (the family's first case: transformers is not
    imported yet in this rank): its DeepSpeed version check passes, it registers the attention, hands the
    unit to ``initialize(mpu=...)`` without ``sequence_parallel_size`` in the config and wraps the
    prepared loader.  The loader is split over the ranks, so the group trains each sample once, in order;
    the loss is ``sequence_loss`` and the prompts leave slices with no counted token."""
    import zeroshard

    zeroshard.install_as_deepspeed()
    from accelerate import Accelerator, PartialState
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedPlugin, DeepSpeedSequenceParallelConfig

    from zeroshard.sequence import restore_transformers_attention, sequence_loss

    samples = [{k: v[:1] for k, v in sample(i).items()} for i in range(len(LENGTHS))]
    net, lr = llama(), 0.5
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    expected = []
    for batch in samples:
        loss = net(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss.detach()))
    PartialState(cpu=True)
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                           "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}})
    acc = Accelerator(deepspeed_plugin=plugin,
                      parallelism_config=ParallelismConfig(sp_size=world, sp_backend="deepspeed", sp_handler=handler))
    model = llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loader = torch.utils.data.DataLoader(samples, batch_size=1, collate_fn=lambda batch: batch[0])
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        outputs = model(**batch)
        loss = sequence_loss(outputs.logits, batch["shift_labels"])
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    state = model.full_state_dict(rank0_only=False)
    worst = max(float((state[n] - v).abs().max()) / float(v.abs().max()) for n, v in net.state_dict().items())
    kinds = (type(model).__name__, type(loader).__name__)
    model.close()
    restore_transformers_attention("sdpa")
    return {"losses": losses, "expected": expected, "worst": worst, "kinds": kinds}


def check_accelerate(by_rank: list[dict[str, Any]], stage: int) -> None:
    for rank, result in enumerate(by_rank):
        assert result["kinds"] == ("Engine", "UlyssesSPDataLoaderAdapter"), result["kinds"]
        assert len(result["losses"]) == len(LENGTHS), result["losses"]
        for step, (got, want) in enumerate(zip(result["losses"], result["expected"])):
            assert abs(got - want) <= 1e-5 * abs(want), (rank, step, got, want)
        assert result["worst"] <= 1e-5, f"rank {rank}: the weights are off by {result['worst']:.2e}"


WORKERS = {"train": train_worker, "refusals": refusals_worker, "accelerate": accelerate_worker}
CHECKS = {"train": check_train, "refusals": check_refusals, "accelerate": check_accelerate}


def ring_case(stage: int, optimizer: str, balanced: bool, **more: Any) -> tuple[str, dict[str, Any]]:
    """The ring at ``stage`` with plain SGD or with AdamW and clipping, with head-tail sharding or not."""
    return ("train", {"stage": stage, "optimizer": optimizer, "clip": CLIP if optimizer == "AdamW" else 0.0,
                      "mode": "balanced" if balanced else "ring", **more})


def ring_cases(**more: Any) -> list[tuple[str, dict[str, Any]]]:
    """The ring at stages 0-3, each with SGD and with AdamW and clipping, head-tail sharding in turn."""
    return [ring_case(stage, optimizer, (stage + index) % 2 == 1, **more)
            for stage in range(4) for index, optimizer in enumerate(("SGD", "AdamW"))]


#: sequence 2 x data 1: Accelerate's path at stage 3 (first: it installs zeroshard as deepspeed before
#: transformers loads); Ulysses with SGD at stages 0, 1 (the degree from the unit alone, as Accelerate
#: passes it) and 3, the tutorial's loss at stage 2, the MLP and the loss tiled at stage 3, AdamW with
#: clipping at stage 3 and, with transformers' activation checkpointing, at stage 2, bf16 with SGD at stage 1
#: (within bf16's tolerance of the fp32 oracle); the refusals; the ring
#: (the config's ``sequence_parallel.mode``) at stages 0-3 with SGD and with AdamW and clipping (at stage 0
#: the degree from the unit alone) and with activation checkpointing at stage 3 (head-tail)
SEQUENCE_2 = [("accelerate", {"stage": 3})]
SEQUENCE_2 += [("train", {"stage": stage, "optimizer": "SGD", "config_sp": stage != 1}) for stage in (0, 1, 3)]
SEQUENCE_2 += [("train", {"stage": 3, "optimizer": "AdamW", "clip": CLIP}),
               ("train", {"stage": 2, "optimizer": "AdamW", "clip": CLIP, "checkpointing": True}),
               ("train", {"stage": 1, "optimizer": "SGD", "bf16": True})]
SEQUENCE_2 += [("train", {"stage": 2, "optimizer": "SGD", "loss": "tutorial"}),
               ("train", {"stage": 3, "optimizer": "SGD", "tiled": True}), ("refusals", {})]
SEQUENCE_2 += [ring_case(0, "SGD", False, config_sp=False)] + ring_cases()[1:]
SEQUENCE_2 += [("train", {"stage": 3, "optimizer": "SGD", "mode": "balanced", "checkpointing": True})]

#: sequence 4 x data 1 (two key/value heads, each repeated on two ranks under Ulysses): Ulysses with SGD at
#: stages 0 and 3, AdamW with clipping at stage 2 with the MLP and the loss tiled; the ring at stages 0-3
#: with SGD and with AdamW and clipping (a degree above the key/value heads), a Llama of 2 heads (a degree
#: above the head count) at stages 0 and 3, and bf16 with SGD at stage 1 (head-tail, within bf16's
#: tolerance of the fp32 oracle).  Sequence 2 x data 2: Ulysses with SGD at stage 1; the ring at stages
#: 0-3, SGD and AdamW with clipping in turn
WORLD_4 = [("train", {"stage": stage, "optimizer": "SGD"}) for stage in (0, 3)]
WORLD_4 += [("train", {"stage": 2, "optimizer": "AdamW", "clip": CLIP, "tiled": True}),
            ("train", {"stage": 1, "optimizer": "SGD", "sp": 2})]
WORLD_4 += ring_cases() + [ring_case(0, "SGD", False, heads=2), ring_case(3, "AdamW", True, heads=2)]
WORLD_4 += [ring_case(1, "SGD", True, bf16=True)]
WORLD_4 += [ring_case(stage, optimizer, balanced, sp=2) for stage, optimizer, balanced in
            ((0, "SGD", False), (1, "AdamW", True), (2, "SGD", True), (3, "AdamW", False))]


def test_hugging_face_llama_at_sequence_2_matches_one_process() -> None:
    """Sequence 2 x data 1: ``SEQUENCE_2``'s cases."""
    check_family(SEQUENCE_2, run_family(2, SEQUENCE_2, WORKERS), CHECKS, world=2)


@pytest.mark.slow
def test_hugging_face_llama_in_a_world_of_4_matches_one_process() -> None:
    """Sequence 4 x data 1 and 2 x 2: ``WORLD_4``'s cases."""
    check_family(WORLD_4, run_family(4, WORLD_4, WORKERS), CHECKS, world=4)


TUTORIAL = Path(__file__).parent / "ds_scripts" / "alst_tutorial.py"


def tutorial_reference(model_dir: Path, samples: list[tuple[torch.Tensor, ...]], lr: float) -> dict[str, Any]:
    """One process: each sample twice in a row (the tutorial's loader is not split over the two ranks, so
    the adapter hands the group each rank's copy), transformers' own loss, plain SGD."""
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model_dir).float()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses, norms = [], []
    for ids, positions, labels in (s for s in samples for _ in range(2)):
        loss = net(input_ids=ids[None], position_ids=positions[None], labels=labels[None]).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "norms": norms, "weights": {n: p.detach() for n, p in net.named_parameters()}}


@pytest.mark.slow
def test_the_alst_tutorial_script_trains_unmodified_under_zeroshard_run_as_deepspeed(tmp_path: Path) -> None:
    """The tutorial's loop at ZeRO-0 (where a gradient averaged over the data ranks alone would come out
    twice the oracle's): losses, gradient norms and weights equal one process's."""
    llama().save_pretrained(tmp_path / "model")
    samples = [tuple(batch[k][0] for k in ("input_ids", "position_ids", "labels"))
               for batch in (sample(i, every_slice_counts=True) for i in range(STEPS))]
    torch.save(samples, tmp_path / "data.pt")
    lr = 0.5
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
                                                  "zero_optimization": {"stage": 0},
                                                  "optimizer": {"type": "SGD", "params": {"lr": lr}}}))
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "run", "--as-deepspeed", "--num_gpus", "2",
                           "--master_port", str(free_port()), str(TUTORIAL), "--model", str(tmp_path / "model"),
                           "--data", str(tmp_path / "data.pt"), "--config", str(tmp_path / "ds.json"),
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got, want = json.loads(out.read_text()), tutorial_reference(tmp_path / "model", samples, lr)
    assert len(got["losses"]) == 2 * STEPS
    for name in ("losses", "norms"):
        for step, (a, b) in enumerate(zip(got[name], want[name])):
            assert abs(a - b) <= 1e-5 * abs(b), (name, step, a, b)
    for name, expected in want["weights"].items():
        off = float((torch.tensor(got["weights"][name]) - expected).abs().max()) / float(expected.abs().max())
        assert off <= 1e-5, f"{name} is off by {off:.2e}"

