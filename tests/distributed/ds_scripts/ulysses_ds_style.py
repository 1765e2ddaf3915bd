"""A DeepSpeed-Ulysses training script written as DeepSpeed's users write one: ``import deepspeed``,
``DistributedAttention`` from ``deepspeed.sequence.layer`` around a local attention, the sequence group from
``deepspeed.utils.groups``, ``sequence_parallel_size`` in the config; each rank trains on its slice of every
sequence.  Run it with ``zeroshard run --as-deepspeed``.

    zeroshard run --as-deepspeed --num_gpus 2 ulysses_ds_style.py --deepspeed_config ds.json --data data.pt --out out.json

``--reference LR`` trains the same model in this one process on the whole sequences with torch's SGD (no
engine, no group: ``DistributedAttention`` is then its local attention): the oracle.
"""

import argparse
import json

import deepspeed
import torch
from deepspeed.sequence.layer import DistributedAttention
from deepspeed.utils import groups
from torch import nn

VOCAB, HIDDEN, HEADS = 31, 16, 4


class LocalAttention(nn.Module):
    def forward(self, q, k, v):  # [batch, sequence, heads, head_dim]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class Model(nn.Module):
    def __init__(self, length):
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(length, HIDDEN)
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.attention = DistributedAttention(LocalAttention(), groups._get_sequence_parallel_group(),
                                              scatter_idx=2, gather_idx=1)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, positions, labels):
        x = self.embed(tokens) + self.position(positions)
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, HEADS, HIDDEN // HEADS) for t in self.qkv(x).chunk(3, dim=-1))
        x = x + self.out(self.attention(q, k, v).reshape(b, s, HIDDEN))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference", type=float, help="the learning rate of one process's plain SGD")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    tokens, labels = torch.load(args.data)  # [steps, batch, length] each
    if args.reference is not None:
        return reference(args, tokens, labels)
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = Model(tokens.shape[-1])
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    size, rank = groups._get_sequence_parallel_world_size(), groups._get_sequence_parallel_rank()
    part = tokens.shape[-1] // size
    mine = slice(rank * part, (rank + 1) * part)
    positions = torch.arange(tokens.shape[-1])[mine].expand(tokens.shape[1], -1)
    losses = []
    for step in range(tokens.shape[0]):
        loss = engine(tokens[step][:, mine], positions, labels[step][:, mine])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    gathered = [None] * deepspeed.comm.get_world_size()
    torch.distributed.all_gather_object(gathered, losses)
    weights = {name: value.tolist() for name, value in engine.module.state_dict().items()}
    if deepspeed.comm.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": gathered, "weights": weights, "sequence_world": size}, f)


def reference(args, tokens, labels):
    torch.manual_seed(0)
    model = Model(tokens.shape[-1])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.reference)
    positions = torch.arange(tokens.shape[-1]).expand(tokens.shape[1], -1)
    losses = []
    for step in range(tokens.shape[0]):
        loss = model(tokens[step], positions, labels[step])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "weights": {n: v.tolist() for n, v in model.state_dict().items()}}, f)


if __name__ == "__main__":
    main()
