"""FP8 layers in a pipeline's stages and in expert-parallel MoE layers, each with its one-process oracle
(test_fp8.py's world runs them).

Both oracles quantise as the parallel runs do, because tensorwise scales are taken per call over the
tensors a GEMM sees.  A pipeline stage calls its layers once per micro-batch and pass, so the oracle runs
the same micro-batches one at a time.  An expert of an MoE layer with ``ep_size`` 2 in a world of two is
called once per forward, on the slot buffers of both ranks (the all-to-all brings each rank's slots for
it, the source ranks in order), and its backward once, on the gradients of both ranks' slots: so the
oracle routes each rank's batch apart (routing and capacity are per rank) and runs each expert once on
the two ranks' slots concatenated in rank order, then backpropagates the mean of the ranks' losses
once.  The expert's GEMMs then see the same tensors as on the rank that holds it; what differs is the
order of fp32 sums elsewhere (the dense layers' gradients summed across ranks, the clipping norm).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from zs_common import CLIP, LR, WD, global_batch

import zeroshard
from zeroshard.deepspeed.utils import safe_get_full_fp32_param
from zeroshard.experts import MoE
from zeroshard.fp8 import convert, fp8_layers
from zeroshard.moe.utils import split_params_into_different_moe_groups_for_optimizer
from zeroshard.pipe import LayerSpec, PipelineModule
from zeroshard.tools.demo.model import Block, GPTConfig


def full_masters(engine: Any) -> dict[str, torch.Tensor]:
    full = {name: safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()}
    return {k: v for k, v in full.items() if v is not None}


# ---------------------------------------------------------------------------------------------- pipeline
class Embed(nn.Module):
    """A pipeline's first layer: token and position embeddings."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(cfg.vocab_size, cfg.d_model), nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))


#: the pipelined GPT (FP8 GEMMs take sizes that are multiples of 16); micro-batches per batch; the layers' seed
PIPE_GPT, PIPE_ACCUM, PIPE_MICRO, SEED = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_head=2, attn_bias=False), 4, 2, 1234
#: layer 5, the head, is on the last stage only: excluded by its global name, which that stage alone holds
PIPE_EXCLUDE = ["5"]
#: each stage's FP8 layers by global name: its block's four linears, and stage 0's layer that is a linear
PIPE_FP8_LAYERS = [["1.fc", "1.out", "1.proj", "1.qkv", "2"], ["3.fc", "3.out", "3.proj", "3.qkv"]]


def pipe_specs() -> list[Any]:
    """Stage 0: the embeddings, a block and a layer that is itself a linear; stage 1: a block, the norm, the
    head."""
    d = PIPE_GPT.d_model
    return [LayerSpec(Embed, PIPE_GPT), LayerSpec(Block, PIPE_GPT), LayerSpec(nn.Linear, d, d),
            LayerSpec(Block, PIPE_GPT), LayerSpec(nn.LayerNorm, d), LayerSpec(nn.Linear, d, PIPE_GPT.vocab_size)]


def pipe_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, PIPE_GPT.vocab_size), labels.reshape(-1))


def pipe_micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = global_batch(step, PIPE_MICRO * PIPE_ACCUM, PIPE_GPT)
    return [(x[j * PIPE_MICRO:(j + 1) * PIPE_MICRO], y[j * PIPE_MICRO:(j + 1) * PIPE_MICRO]) for j in range(PIPE_ACCUM)]


@functools.lru_cache(maxsize=None)
def pipeline_oracle(steps: int) -> dict[str, torch.Tensor]:
    """The pipeline's layers as one ``nn.Sequential`` (each built from the seed its stage uses, named as the
    stages name them globally), converted alike, trained on the same micro-batches one at a time."""
    layers = []
    for index, spec in enumerate(pipe_specs()):
        torch.manual_seed(SEED + index)
        layers.append(spec.build())
    model = nn.Sequential(*layers)
    convert(model, "tensorwise", exclude=PIPE_EXCLUDE)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(steps):
        for x, y in pipe_micro_batches(step):
            (pipe_loss(model(x), y) / PIPE_ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def pipelined(world: int, config: dict[str, Any], steps: int) -> dict[str, Any]:
    """2 stages with FP8 layers: this stage's fp32 parameters and its FP8 layers, by global name."""
    module = PipelineModule(pipe_specs(), num_stages=world, loss_fn=pipe_loss, seed_layers=True, base_seed=SEED,
                            partition_method="uniform")
    config = {**config, "train_micro_batch_size_per_gpu": PIPE_MICRO, "gradient_accumulation_steps": PIPE_ACCUM,
              "fp8": {**config["fp8"], "exclude": PIPE_EXCLUDE}}
    engine, _, _, _ = zeroshard.initialize(model=module, config=config)
    for step in range(steps):
        engine.train_batch(iter(pipe_micro_batches(step)))
    params = {module.global_name(name): value for name, value in full_masters(engine).items()}
    layers = sorted(module.global_module_name(name) for name in fp8_layers(module))
    engine.close()
    return {"params": params, "layers": layers}


# ---------------------------------------------------------------------------------------------- experts
VOCAB, WIDTH, ROWS, EXPERTS, AUX = 32, 32, 12, 4, 0.01
EXPERT_PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."


class MoEModel(nn.Module):
    """An embedding, an MoE layer of two-linear experts (top-2, token dropping), a head."""

    def __init__(self, ep_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.moe = MoE(WIDTH, nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH)),
                       num_experts=EXPERTS, ep_size=ep_size, k=2, capacity_factor=1.0, min_capacity=2,
                       use_rts=False, drop_tokens=True, top2_2nd_expert_sampling=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        out, l_aux, _ = self.moe(h)
        return self.loss(h, out, y, l_aux)

    def loss(self, h: torch.Tensor, out: torch.Tensor, y: torch.Tensor, l_aux: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(torch.tanh(h + out)), y) + AUX * l_aux


def moe_start() -> dict[str, torch.Tensor]:
    """The one-process model's first values, every expert its own."""
    torch.manual_seed(0)
    model = MoEModel(1)
    with torch.no_grad():
        for i, expert in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
            for p in expert.parameters():
                p.add_(0.1 * (i + 1))
    return model.state_dict()


def expert_global_name(local: str, ep_rank: int, local_experts: int) -> str:
    """An expert parameter's name in the one-process model (its global expert index)."""
    if not local.startswith(EXPERT_PREFIX):
        return local
    index, rest = local[len(EXPERT_PREFIX):].split(".", 1)
    return f"{EXPERT_PREFIX}{ep_rank * local_experts + int(index)}.{rest}"


def moe_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (ROWS,), generator=g), torch.randint(0, VOCAB, (ROWS,), generator=g)


def moe_groups(model: nn.Module) -> list[dict]:
    return split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "weight_decay": WD})


def expert_parallel_losses(model: MoEModel, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Each rank's loss, every expert run once on all ranks' slots (see the module's docstring)."""
    layer = model.moe.deepspeed_moe
    hidden, routes, slots = [], [], []
    for x, _ in batches:  # each rank's batch routed apart
        h = model.embed(x)
        tokens = h.reshape(-1, WIDTH)
        route = layer.gate(tokens, None, None)
        hidden.append(h)
        routes.append(route)
        slots.append(torch.einsum("sec,sm->ecm", route.dispatch.to(tokens.dtype), tokens))
    capacity = slots[0].shape[1]
    out = layer.experts(torch.cat(slots, dim=1))  # [experts, ranks * capacity, width], the ranks in order
    losses = []
    for r, ((_, y), h, route) in enumerate(zip(batches, hidden, routes)):
        mine = out[:, r * capacity:(r + 1) * capacity]
        combined = torch.einsum("sec,ecm->sm", route.combine.to(mine.dtype), mine).reshape(h.shape)
        losses.append(model.loss(h, combined, y, route.l_aux))
    return losses


@functools.lru_cache(maxsize=None)
def moe_oracle(world: int, steps: int) -> dict[str, torch.Tensor]:
    """One process holding every expert, converted alike (the router and head kept), as the module's
    docstring says; its fp32 parameters."""
    model = MoEModel(1)
    model.load_state_dict(moe_start())
    convert(model, "tensorwise")
    opt = torch.optim.AdamW(moe_groups(model), lr=LR, weight_decay=WD)
    for step in range(steps):
        (sum(expert_parallel_losses(model, [moe_batch(step, r) for r in range(world)])) / world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def moe_trained(rank: int, world: int, config: dict[str, Any], steps: int) -> dict[str, Any]:
    """``ep_size`` = world (each rank holds two experts) with FP8 experts, in fp32: every parameter under
    the one-process model's names (``full_state_dict`` names every expert globally), and the FP8 layers."""
    local = EXPERTS // world
    model = MoEModel(world)
    start = moe_start()
    model.load_state_dict({name: start[expert_global_name(name, rank, local)] for name in model.state_dict()})
    config = {**config, "train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1}
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=moe_groups(model), config=config)
    for step in range(steps):
        engine.backward(engine(*moe_batch(step, rank)))
        engine.step()
    params = engine.full_state_dict(rank0_only=False)
    layers = fp8_layers(model)
    engine.close()
    return {"params": params, "layers": layers}
