"""A DeepSpeed training script with DeepSpeed's Muon optimizer: a tiny GPT, deterministic data, one loss
per step.  It says ``import deepspeed`` and nothing of zeroshard, so it runs under real DeepSpeed
(``torchrun`` from a virtual environment that has it) and under ``zeroshard run --as-deepspeed``;
``benchmarks/compare_deepspeed_muon.py`` runs it both ways and compares the losses.

    torchrun --nproc-per-node 2 benchmarks/deepspeed_muon_script.py --stage 2 --steps 25 --out losses.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH, LAYERS, MICRO = 64, 16, 32, 2, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).view(x.size(0), x.size(1), 3, 4, WIDTH // 4).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape_as(x))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class TinyGPT(nn.Module):
    """Token and position embeddings (names with ``embed``: Adam's), two blocks (Muon's matrices, Adam's
    biases and norms) and an untied ``lm_head`` (Adam's)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.embed_positions = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) + self.embed_positions(torch.arange(x.size(1)))
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.lm_head(self.norm(h)).flatten(0, 1), y.flatten())


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's global batch: a noisy repeating pattern, so the loss can fall."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (MICRO * world, 1), generator=g)
    data = (start + torch.arange(SEQ + 1) * 3) % VOCAB
    noise = torch.rand(data.shape, generator=g) < 0.1
    data = torch.where(noise, torch.randint(0, VOCAB, data.shape, generator=g), data)
    rows = data[rank * MICRO:(rank + 1) * MICRO]
    return rows[:, :-1], rows[:, 1:]


def config(stage: int, ns_method: str) -> dict:
    """DeepSpeed's Muon (its own defaults spelled out: momentum 0.95, Adam betas (0.9, 0.95)), torch's AdamW
    for the rest (DeepSpeed's FusedAdam is a JIT-built kernel; the update is the same), fp32,
    no clipping (DeepSpeed clips Muon's orthogonalised update at stages 1-2, zeroshard the gradient)."""
    zero: dict = {"stage": stage}
    if stage == 3:
        zero["reduce_scatter"] = False  # DeepSpeed refuses Muon with stage 3's reduce-scatter
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "Muon", "params": {"lr": 0.01, "muon_lr": 0.02, "adam_lr": 3e-3, "momentum": 0.95,
                                                     "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01,
                                                     "torch_adam": True, "ns_method": ns_method}},
            "zero_optimization": zero, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--ns-method", default="gram")
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # the DeepSpeed launcher's argument
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config(args.stage, args.ns_method))
    marked = sorted(n for n, p in model.named_parameters() if getattr(p, "use_muon", False))
    losses = []
    for step in range(args.steps):
        loss = engine(*batch(step, rank, world))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "deepspeed": getattr(deepspeed, "__version__", "?"), "torch": torch.__version__,
                       "use_muon": marked, "optimizer": type(engine.optimizer).__name__}, f, indent=1)


if __name__ == "__main__":
    main()
