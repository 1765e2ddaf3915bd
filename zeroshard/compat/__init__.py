"""zeroshard under DeepSpeed's names: the thin layer that lets DeepSpeed scripts, Hugging Face and
Accelerate drive zeroshard (see [Note: one thin layer for DeepSpeed's names] in engine_api.py)."""
