"""A training script as a user writes it for an elastic job: periodic saves and auto-resume from the
config, nothing else.  On the first attempt, rank VICTIM kills itself with SIGKILL after step KILL_AT;
torchrun (--max-restarts) restarts the group, which resumes from the newest complete checkpoint.

usage: train_until_killed.py OUT STEPS VICTIM KILL_AT
"""

import os
import signal
import sys
from pathlib import Path

import torch

import zeroshard
from zeroshard.tools.demo.model import GPT, GPTConfig

out, steps, victim, kill_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=61, seq_len=8, d_model=16, n_layer=2, n_head=2, attn_bias=False))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
          "checkpoint": {"save_dir": str(out / "ckpt"), "save_interval": 2, "keep_last": 2, "auto_resume": True}}
engine, _, _, _ = zeroshard.initialize(model=model, config=config)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = engine.world.rank
while engine.global_steps < steps:
    for micro in range(2):
        g = torch.Generator().manual_seed(10_000 * engine.global_steps + 100 * rank + micro)
        data = torch.randint(0, 61, (2, 9), generator=g)
        engine.backward(engine(data[:, :-1], data[:, 1:]))
        engine.step()
    if attempt == 0 and rank == victim and engine.global_steps == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
state = engine.full_state_dict()
if rank == 0:
    torch.save({"state": state, "attempt": attempt, "steps": engine.global_steps}, out / "final.pt")
engine.close()
