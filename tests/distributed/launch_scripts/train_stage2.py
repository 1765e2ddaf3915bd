"""One rank of a two-rank job started without torchrun: joins by the way ``how`` names, trains a tiny model
at ZeRO stage 2 for two steps on its own rank's data, and saves what it ended with to OUT/rank<r>.pt.

    python train_stage2.py OUT HOW [INIT_METHOD RANK WORLD_SIZE]

HOW: ``explicit`` (``zeroshard.init_distributed(init_method=, rank=, world_size=)``), ``initialize`` (the
launcher's variables, read by ``zeroshard.initialize`` alone), ``comm`` (``deepspeed.comm``'s
``init_distributed(distributed_port=)`` with the launcher's variables).
"""

import os
import sys
from pathlib import Path

import torch
from torch import nn

import zeroshard

out, how = Path(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
if how == "explicit":
    zeroshard.init_distributed(init_method=sys.argv[3], rank=int(sys.argv[4]), world_size=int(sys.argv[5]))
elif how == "comm":
    zeroshard.comm.init_distributed(distributed_port=int(os.environ["TEST_PORT"]))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, "zero_optimization": {"stage": 2}}
engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
rank = engine.world.rank
data = torch.Generator().manual_seed(100 + rank)  # each rank its own samples: equal results need the all-reduce
for _ in range(2):
    x, y = torch.randn(2, 6, generator=data), torch.randn(2, 3, generator=data)
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
torch.save({"rank": rank, "world_size": engine.world.world_size, "local_rank": engine.world.local_rank,
            "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                   "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")},
            "device_count": zeroshard.accelerator.get_accelerator().device_count(),
            "params": [p.detach().clone() for p in model.parameters()]}, out / f"rank{rank}.pt")
