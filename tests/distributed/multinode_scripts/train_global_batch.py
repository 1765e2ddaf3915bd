"""Each rank trains on its slice of the global batch (the tests' tiny GPT); rank 0 writes the result.
Launched by two torchrun agents acting as two nodes (tests/distributed/test_multinode.py).

usage: train_global_batch.py OUT STAGE STEPS
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # zs_common

import zeroshard  # noqa: E402
from zs_common import make_model, rank_micro_batches, zero_config  # noqa: E402

out, stage, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
config = zero_config(stage, 2, 2, **({"stage3_param_persistence_threshold": 20} if stage == 3 else {}))
config["steps_per_print"] = 1
engine, _, _, _ = zeroshard.initialize(model=make_model(), config=config)
world = engine.world
for step in range(steps):
    for x, y in rank_micro_batches(step, world.rank, world.world_size, 2, 2):
        engine.backward(engine(x, y))
        engine.step()
engine.save_checkpoint(out / "ckpt")
state = engine.full_state_dict()
placement = {"rank": world.rank, "local_rank": world.local_rank, "local_world_size": os.environ["LOCAL_WORLD_SIZE"],
             "group_rank": os.environ["GROUP_RANK"], "world_size": world.world_size}
(out / f"placement{world.rank}.json").write_text(json.dumps(placement))
if world.rank == 0:
    torch.save(state, out / "final.pt")
engine.close()
