"""A Hugging Face Trainer job as its users write it, with a DeepSpeed config, on zeroshard.

    torchrun --nproc_per_node 2 trainer_script.py --stage 3 --out DIR [--bf16] [--pretrained DIR]
             [--resume CKPT] [--resize N] [--ddp]

The only zeroshard line is ``zeroshard.install_as_deepspeed()`` at the top; transformers and accelerate
are used unmodified.  ``--ddp`` runs the same job without DeepSpeed (Trainer's own DDP): the reference.
Writes DIR/result.json (rank 0): losses, optimizer steps run in this launch, what trained it.
"""

import argparse
import json
import os

import zeroshard

zeroshard.install_as_deepspeed()  # before transformers/accelerate are imported

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

VOCAB = 97


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class CountSteps(TrainerCallback):
    steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        CountSteps.steps += 1


def ds_config(stage: int) -> dict:
    # As Hugging Face's documentation writes them: "auto" wherever TrainingArguments knows the value.
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": "auto",
                                  "stage3_prefetch_bucket_size": "auto",
                                  "stage3_param_persistence_threshold": "auto",
                                  "stage3_gather_16bit_weights_on_model_save": True}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--pretrained")
    p.add_argument("--resume")
    p.add_argument("--resize", type=int)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--max_steps", type=int, default=4)
    a = p.parse_args()
    args = TrainingArguments(output_dir=a.out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=a.max_steps, learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0,
                             logging_steps=1, save_steps=2, report_to=[], use_cpu=True, bf16=a.bf16,
                             deepspeed=None if a.ddp else ds_config(a.stage), seed=0, data_seed=0)
    torch.manual_seed(0)
    if a.pretrained:  # at stage 3 built under zero.Init by from_pretrained (HfDeepSpeedConfig)
        model = GPT2LMHeadModel.from_pretrained(a.pretrained)
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    checks = {"dtype": str(model.dtype), "device": str(model.device)}
    if a.resize:
        model.resize_token_embeddings(a.resize)
        checks["embedding_rows"] = model.get_input_embeddings().weight.shape[0]
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[CountSteps()])
    trainer.train(resume_from_checkpoint=a.resume)
    trainer.save_model(os.path.join(a.out, "final"))
    if trainer.is_world_process_zero():
        wrapped = type(trainer.model_wrapped).__module__ + "." + type(trainer.model_wrapped).__name__
        json.dump({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                   "steps_run": CountSteps.steps, "global_step": trainer.state.global_step,
                   "world_size": args.world_size, "wrapped": wrapped, **checks},
                  open(os.path.join(a.out, "result.json"), "w"))
    del trainer, model
    if a.ddp:
        end_ddp()


def end_ddp() -> None:
    """The DDP reference ends as PyTorch recommends: nothing referencing the process group, then
    destroy it (a gloo group torn down at interpreter exit can abort the process; zeroshard does this
    for its own runs, see zeroshard/distributed/world.py)."""
    import gc

    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
