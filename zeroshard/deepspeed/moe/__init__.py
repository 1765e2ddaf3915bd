"""``zeroshard.deepspeed.moe`` (DeepSpeed's ``deepspeed.moe``): only what dense models touch (zeroshard has no MoE layers)."""
