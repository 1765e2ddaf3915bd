"""``zeroshard.deepspeed.moe`` (DeepSpeed's ``deepspeed.moe``): the MoE layer with expert-parallel size 1
(``layer.MoE``, from zeroshard/experts/) and the optimizer-group helpers (``utils``)."""
