"""``deepspeed.runtime.sequence_parallel``: DeepSpeed's ALST (the Hugging Face path of sequence parallelism),
over zeroshard/sequence/ (docs/SEQUENCE_PARALLEL.md, "Hugging Face (ALST)")."""

from . import parallel_state_sp, ulysses_sp

__all__ = ["parallel_state_sp", "ulysses_sp"]
