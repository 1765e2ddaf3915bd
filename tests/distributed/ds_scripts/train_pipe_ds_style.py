"""A pipeline-parallel training script written the way DeepSpeed's pipeline example writes one: a small
AlexNet-like CNN given as a list of layers to ``PipelineModule``, ``deepspeed.initialize(training_data=...)``
and a loop of ``engine.train_batch()``.  It says ``import deepspeed``: run it with

    zeroshard run --as-deepspeed --num_gpus 4 train_pipe_ds_style.py --deepspeed_config ds.json --out losses.json

The data are random CIFAR-shaped images (3x32x32, 10 classes), each class a colour of its own under the
noise, so that the loss can fall within a few steps; nothing is downloaded.
"""

import argparse
import json
import os

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn


def get_args():
    parser = argparse.ArgumentParser(description="CIFAR-shaped pipeline")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=12, help="the batches to train")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline stages")
    parser.add_argument("--seed", type=int, default=1138)
    parser.add_argument("--out", required=True, help="where rank 0 writes the losses (JSON)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class RandomCifar(torch.utils.data.Dataset):
    """CIFAR-10's shapes: a colour per class plus noise."""

    def __init__(self, size=256, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.patterns = 2 * torch.randn(10, 3, 1, 1, generator=g)
        self.labels = torch.randint(0, 10, (size,), generator=g)
        self.noise = torch.randn(size, 3, 32, 32, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        label = int(self.labels[index])
        return self.patterns[label] + self.noise[index], label


def alexnet_layers(num_classes=10):
    """AlexNet's shape, shrunk: convolutions and pooling, then a classifier, as one list of layers."""
    return [
        LayerSpec(nn.Conv2d, 3, 16, kernel_size=3, padding=1), LayerSpec(nn.ReLU), LayerSpec(nn.MaxPool2d, 2),
        LayerSpec(nn.Conv2d, 16, 32, kernel_size=3, padding=1), LayerSpec(nn.ReLU), LayerSpec(nn.MaxPool2d, 2),
        LayerSpec(nn.Conv2d, 32, 32, kernel_size=3, padding=1), LayerSpec(nn.ReLU), LayerSpec(nn.MaxPool2d, 2),
        lambda x: torch.flatten(x, 1),
        LayerSpec(nn.Linear, 32 * 4 * 4, 64), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 64, num_classes),
    ]


def train_pipe(args, part="parameters"):
    torch.manual_seed(args.seed)
    net = PipelineModule(layers=alexnet_layers(), loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size, partition_method=part,
                         activation_checkpoint_interval=0)
    trainset = RandomCifar()
    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=trainset)
    losses = []
    for _ in range(args.steps):
        losses.append(float(engine.train_batch()))
    if deepspeed.comm.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses}, f)


if __name__ == "__main__":
    args = get_args()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    args.local_rank = int(os.environ["LOCAL_RANK"])
    get_accelerator().set_device(args.local_rank)
    train_pipe(args)
