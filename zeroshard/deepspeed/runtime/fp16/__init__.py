"""``deepspeed.runtime.fp16``: DeepSpeed's fp16 optimizer wrappers' module paths (see unfused_optimizer.py)."""
