"""Each rank trains on its slice of the global batch (the tests' tiny GPT); rank 0 writes the result.
Launched by two torchrun agents acting as two nodes (tests/distributed/test_multinode.py).

usage: train_global_batch.py OUT STAGE STEPS [shared | node_local_save | node_local_resume] [mics | hpz]

shared: train STEPS steps, save into OUT/ckpt.  node_local_save: train STEPS - 1 steps, save with
checkpoint.use_node_local_storage into OUT/node<GROUP_RANK> (a directory of that node's own), train the
last step.  node_local_resume: load from OUT/node<GROUP_RANK>, train the last step.  mics / hpz: hybrid
sharding over the two ranks of each node; each rank writes the bytes it sent inside and across nodes.
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
mode = sys.argv[4] if len(sys.argv) > 4 else "shared"
hybrid = {"mics": {"mics_shard_size": 2}, "hpz": {"zero_hpz_partition_size": 2}, "": {}}[
    sys.argv[5] if len(sys.argv) > 5 else ""]
config = zero_config(stage, 2, 2, **({"stage3_param_persistence_threshold": 20} if stage == 3 else {}), **hybrid)
config["steps_per_print"] = 1
config["checkpoint"] = {"use_node_local_storage": mode != "shared"}
engine, _, _, _ = zeroshard.initialize(model=make_model(), config=config)
world = engine.world
node_dir = out / f"node{os.environ['GROUP_RANK']}"


def train(first: int, last: int) -> None:
    for step in range(first, last):
        for x, y in rank_micro_batches(step, world.rank, world.world_size, 2, 2):
            engine.backward(engine(x, y))
            engine.step()


if mode == "shared":
    train(0, steps)
    sent = engine.comm.bytes_sent_by_scope()  # the training steps' traffic
    engine.save_checkpoint(out / "ckpt")
elif mode == "node_local_save":
    train(0, steps - 1)
    engine.save_checkpoint(node_dir)
    train(steps - 1, steps)
    sent = engine.comm.bytes_sent_by_scope()  # the training steps' traffic and the save's agreement
else:
    engine.load_checkpoint(node_dir)
    train(steps - 1, steps)
    sent = engine.comm.bytes_sent_by_scope()
layout = [[b.padded_numel, b.shard_numel] for b in engine.strategy.layout.buckets]  # trainable
state = engine.full_state_dict()
placement = {"rank": world.rank, "local_rank": world.local_rank, "local_world_size": os.environ["LOCAL_WORLD_SIZE"],
             "group_rank": os.environ["GROUP_RANK"], "world_size": world.world_size, "sent": sent,
             "layout": layout}
(out / f"placement{world.rank}.json").write_text(json.dumps(placement))
if world.rank == 0:
    torch.save(state, out / f"final_{mode}.pt")
engine.close()
