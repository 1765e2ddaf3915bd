"""Pipeline parallelism composed with ZeRO: DeepSpeed's ``deepspeed.pipe`` (docs/PIPELINE.md).

``PipelineModule`` splits a list of layers between stages (module.py, partition.py, specs.py, tied.py);
``initialize()`` wraps it in a ``PipelineEngine`` (engine.py), one ZeRO engine per stage over that
stage's data-parallel ranks, driven by a schedule (schedule.py, executor.py) whose messages between
stages are point-to-point (p2p.py).
"""

from .checks import PipelineBatchSizeError, PipelineConfigError
from .engine import PipelineEngine, PipelineUsageError
from .module import PipeDataParallelTopology, PipeModelDataParallelTopology, PipelineModule, TiedChunkError
from .partition import PartitionMethodError, TooFewLayersError
from .schedule import GPipe, InterleavedOneFOneB, OneFOneB, PipeSchedule
from .specs import LayerSpec, TiedLayerSpec
from ..distributed.parallel_dims import ParallelDims, StagesDoNotDivideError

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineEngine",
           "PipeSchedule", "OneFOneB", "GPipe", "InterleavedOneFOneB", "TiedChunkError", "ParallelDims", "PipelineBatchSizeError", "PipelineConfigError",
           "PipelineUsageError", "StagesDoNotDivideError", "TooFewLayersError", "PartitionMethodError"]
