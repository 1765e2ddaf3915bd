"""``deepspeed.runtime.pipe.topology``: DeepSpeed's pipeline x data (x tensor) topologies, zeroshard's
(pipeline/module.py)."""

from ....pipeline import PipeDataParallelTopology, PipeModelDataParallelTopology

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology"]
