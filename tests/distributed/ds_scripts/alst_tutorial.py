"""DeepSpeed's ALST tutorial's training loop (Ulysses sequence parallelism for Hugging Face transformers), as
the tutorial writes it, with its model, data and config from the command line:

    zeroshard run --as-deepspeed --num_gpus 2 alst_tutorial.py --model DIR --data FILE --config FILE --out FILE

The loader is not split over the ranks (as in the tutorial): every rank draws every sample and the
adapter hands the group each rank's copy in turn.  Rank 0 writes each step's loss and gradient norm and
the final weights.
"""

import argparse
import json

from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from deepspeed.runtime.utils import move_to_device
from deepspeed.utils import groups
from deepspeed.utils import safe_get_full_fp32_param
from deepspeed.accelerator import get_accelerator
from transformers import AutoModelForCausalLM
import deepspeed
import deepspeed.comm as dist
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--data", required=True)
parser.add_argument("--config", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()

model_name_or_path = args.model
sequence_parallel_size = 2
micro_batch_size = 1

with open(args.config) as f:
    config_dict = json.load(f)
config_dict["sequence_parallel_size"] = sequence_parallel_size

# a list of (input_ids, position_ids, labels) samples of varying lengths
ds = torch.load(args.data)


def collate_fn(batch):
    input_ids, position_ids, labels = batch[0]
    return dict(input_ids=input_ids.unsqueeze(0),
                position_ids=position_ids.unsqueeze(0),
                labels=labels.unsqueeze(0))


dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(), dist_init_required=True)

# Ulysses injection into HF Transformers
mpu = UlyssesSPAttentionHF.register_with_transformers(
    model_name_or_path=model_name_or_path,
    core_attn_implementation="sdpa",
    sequence_parallel_size=sequence_parallel_size,
    micro_batch_size=micro_batch_size,
    seq_length_is_variable=True,
)

# Deepspeed setup
model = AutoModelForCausalLM.from_pretrained(model_name_or_path)
model, _, _, _ = deepspeed.initialize(config=config_dict,
                                      model=model,
                                      model_parameters=model.parameters(),
                                      mpu=mpu)

# UlyssesSPDataLoaderAdapter injection
sp_group = groups._get_sequence_parallel_group()
sp_world_size = groups._get_sequence_parallel_world_size()
sp_rank = groups._get_sequence_parallel_rank()
dl = torch.utils.data.DataLoader(ds, batch_size=micro_batch_size, collate_fn=collate_fn)
dl = UlyssesSPDataLoaderAdapter(
    dl,
    sp_rank=sp_rank,
    sp_group=sp_group,
    sp_world_size=sp_world_size,
    device=model.device,
)

# Normal training loop
losses, norms = [], []
for iter, batch in enumerate(dl):
    batch = move_to_device(batch, model.device)

    outputs = model(**batch)
    shift_labels = batch["shift_labels"]
    loss = model.module.loss_function(
        logits=outputs.logits,
        labels=None,
        shift_labels=shift_labels,
        vocab_size=model.module.config.vocab_size,
    )

    # differentiable weighted per-shard-loss aggregation across ranks
    losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
    # special dealing with SFT that has prompt tokens that aren't used in loss computation
    good_tokens = (shift_labels != -100).view(-1).sum()
    good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
    total_loss = sum(losses_per_rank[rank] * good_tokens_per_rank[rank] for rank in range(sp_world_size))
    total_good_tokens = sum(good_tokens_per_rank)
    loss = total_loss / max(total_good_tokens, 1)

    if dist.get_rank() == 0:
        print(f"{iter}: {loss=}")

    model.backward(loss)
    model.step()
    losses.append(loss.item())
    norms.append(model.get_global_grad_norm())

weights = {name: safe_get_full_fp32_param(p).tolist() for name, p in model.module.named_parameters()}
if dist.get_rank() == 0:
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "norms": norms, "weights": weights}, f)
