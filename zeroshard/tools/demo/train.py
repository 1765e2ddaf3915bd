"""The demo training job: a byte-level GPT learns Python from the standard library's source.

Launched by ``zeroshard demo`` (which wraps torchrun); run it directly with

    torchrun --standalone --nproc_per_node 2 -m zeroshard.tools.demo.train --stage 3 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import zeroshard
from zeroshard.tools.demo.data import ByteWindows, stdlib_bytes
from zeroshard.tools.demo.lora import add_lora
from zeroshard.tools.demo.model import GPT, GPTConfig
from zeroshard.logging import log_rank

MODEL = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layer=4, n_head=4)


def progress_bar(total: int, enabled: bool) -> tqdm:
    """The ecosystem's progress bar on rank 0, the metrics as its postfix; off a terminal (CI logs)
    it redraws about every 10% of the run instead of continuously."""
    interactive = sys.stderr.isatty()
    return tqdm(total=total, disable=not enabled, file=sys.stderr, dynamic_ncols=interactive, unit="step",
                mininterval=0.1 if interactive else 0.0, miniters=1 if interactive else max(1, total // 10))


def default_config(stage: int, steps: int, precision: str = "fp32", lr: float = 3e-3) -> dict:
    # fp32 by default: at this model size bf16 is no faster on CPU (benchmarks/RESULTS.md, section "Main job")
    mixed = {precision: {"enabled": True}} if precision != "fp32" else {}
    return {
        **mixed,
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": max(1, steps // 10),
        "wall_clock_breakdown": True,
        "seed": 1234,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_num_steps": max(1, steps // 10), "warmup_max_lr": lr,
                                 "total_num_steps": steps, "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200_000, "allgather_bucket_size": 400_000,
                              # this model's matrices are small: shard all but biases and norms
                              "stage3_param_persistence_threshold": 1000},
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="fp32",
                        help="training precision of the built-in config (bf16: fp32 master weights)")
    parser.add_argument("--config", help="a DeepSpeed-style JSON config replacing the built-in one")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="where the checkpoint and weights go")
    parser.add_argument("--lora", action="store_true",
                        help="fine-tune with LoRA adapters: the base (OUT/model.safetensors of an earlier run, "
                             "loaded into the shards) frozen and, at stage 3, sharded; results go to OUT/lora")
    return parser.parse_args()


@torch.no_grad()
def held_out_loss(engine: zeroshard.Engine, data: ByteWindows) -> float:
    engine.eval()
    device = engine.world.device
    xs = torch.stack([data[i][0] for i in range(len(data) - 32, len(data))]).to(device)
    ys = torch.stack([data[i][1] for i in range(len(data) - 32, len(data))]).to(device)
    loss = float(engine(xs, ys))
    engine.train()
    return loss


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    config = json.load(open(args.config)) if args.config else default_config(args.stage, args.steps, args.precision,
                                                                              lr=1e-2 if args.lora else 3e-3)
    config.setdefault("metrics_path", str(args.out / "metrics.jsonl"))
    if dist.is_available() and "RANK" in os.environ and os.environ["RANK"] == "0":
        (args.out / "metrics.jsonl").unlink(missing_ok=True)  # one run, one metrics file
    torch.manual_seed(0)
    model = lora_model(args, config) if args.lora else GPT(MODEL)
    if args.lora:
        args.out = args.out / "lora"
        config["metrics_path"] = str(args.out / "metrics.jsonl")
    data = ByteWindows(stdlib_bytes(), MODEL.seq_len)
    engine, _, loader, _ = zeroshard.initialize(model=model, config=config, training_data=data)
    assert loader is not None
    log_rank(f"training a {sum(p.numel() for p in model.parameters()):,}-parameter byte-level GPT on "
             f"{len(data):,} windows of Python source: ZeRO stage {engine.stage}, world size "
             f"{engine.world.world_size}, global batch {engine.train_batch_size()}")
    start_loss = held_out_loss(engine, data)
    started = time.perf_counter()
    batches = iter(loader)
    bar = progress_bar(args.steps, engine.world.is_main)
    tokens_done = 0
    while engine.global_steps < args.steps:
        try:
            x, y = next(batches)
        except StopIteration:  # the loader moves to the next epoch (a new shuffle) by itself
            batches = iter(loader)
            continue
        x, y = x.to(engine.world.device), y.to(engine.world.device)  # the loader's batches are on the CPU
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        tokens_done += x.numel() * engine.world.world_size
        bar.set_postfix_str(f"loss {loss.item():.3f} {tokens_done / (time.perf_counter() - started):,.0f} tokens/s",
                            refresh=False)
        bar.update(engine.global_steps - bar.n)
    bar.close()
    elapsed = time.perf_counter() - started
    end_loss = held_out_loss(engine, data)
    log_rank(f"held-out loss {start_loss:.3f} -> {end_loss:.3f} in {engine.global_steps} steps "
             f"({elapsed:.1f}s, {engine.global_samples * MODEL.seq_len / elapsed:,.0f} tokens/s)")
    report_memory(engine)
    if args.lora:
        frozen = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log_rank(f"LoRA: {trained:,} trained parameters; the frozen base is {frozen / 2**20:.2f} MiB in all, and "
                 f"each rank holds its share of it (frozen_params above)")
    saved = engine.save_checkpoint(args.out / "checkpoint")
    if engine.world.is_main:
        from zeroshard.checkpoint import consolidate

        weights = consolidate(saved, args.out / "model.safetensors")
        log_rank(f"checkpoint: {saved} (resume with engine.load_checkpoint); consolidated weights: {weights}; "
                 f"metrics: {config['metrics_path']}")
        try:
            from zeroshard.tools.plots import plot_metrics

            log_rank(f"plot: {plot_metrics(config['metrics_path'], args.out / 'metrics.png')}")
        except ImportError as err:
            log_rank(f"no plot: {err}")
    engine.eval()
    with zeroshard.GatheredParameters(list(model.parameters())):  # every rank: it gathers at stage 3
        if engine.world.is_main:
            device = engine.world.device  # the prompt and the sampler's generator where the model is
            prompt = torch.tensor([list(b"def ")], device=device)
            sample = model.generate(prompt, 120, generator=torch.Generator(device).manual_seed(0))
            print("---- sample ----\n" + bytes(sample[0].tolist()).decode("utf-8", "replace") + "\n----------------")


def lora_model(args: argparse.Namespace, config: dict) -> GPT:
    """The demo model with LoRA adapters: built under ``zeroshard.Init`` (stage 3), its base weights read
    into the shards from an earlier run's ``OUT/model.safetensors`` when there is one."""
    base = args.out / "model.safetensors"
    with zeroshard.Init(config=config, enabled=args.stage == 3):
        model = GPT(MODEL)
    if base.is_file():
        zeroshard.load_pretrained(model, base)  # each rank reads its own slices
        log_rank(f"LoRA: base weights from {base}")
    else:
        log_rank(f"LoRA: no {base} (run `bash run.sh` first): the adapters fine-tune the initial weights",
                 level=30)
    torch.manual_seed(1)
    return add_lora(model)


def report_memory(engine: zeroshard.Engine) -> None:
    """Each rank prints its memory breakdown, in rank order."""
    for rank in range(engine.world.world_size):
        if rank == engine.world.rank:
            mb = engine.memory_breakdown()
            parts = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in mb.items() if k != "formula" and v)
            print(f"rank {rank} memory: {parts} (ZeRO-{engine.stage} formula {mb['formula'] / 2**20:.2f} MiB)",
                  flush=True)
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    main()
