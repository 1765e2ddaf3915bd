"""``zeroshard.runtime`` (DeepSpeed's ``deepspeed.runtime``): the module paths DeepSpeed code imports from."""
