"""``deepspeed.ops.op_builder``: DeepSpeed's op builders, which build nothing under zeroshard.

DeepSpeed compiles C++/CUDA extensions (its CPU Adam, fused Adam, asynchronous I/O, ...) through one
builder class per op; scripts and test suites ask a builder ``is_compatible()`` before using the op.
zeroshard compiles nothing: what those ops are for it does with torch's kernels or its own Python
code, or not at all.  So here ``is_compatible()`` says whether zeroshard provides what the op is for
(no build needed), and ``load()`` (like ``builder()`` and ``jit_load()``) raises
:class:`OpNotBuiltError`, naming what zeroshard uses instead, or that it has no counterpart.
``ALL_OPS`` maps each op's ``NAME`` to a builder, as DeepSpeed's does.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["OpBuilder", "OpNotBuiltError", "ALL_OPS", "compatible_ops", "CPUAdamBuilder", "CPUAdagradBuilder",
           "CPULionBuilder", "FusedAdamBuilder", "FusedLambBuilder", "FusedLionBuilder", "AsyncIOBuilder",
           "GDSBuilder", "PinMemoryBuilder", "UtilsBuilder", "TransformerBuilder", "StochasticTransformerBuilder",
           "InferenceBuilder", "InferenceCoreBuilder", "InferenceCutlassBuilder", "RaggedOpsBuilder",
           "RaggedUtilsBuilder", "QuantizerBuilder", "FPQuantizerBuilder", "RandomLTDBuilder",
           "SpatialInferenceBuilder", "EvoformerAttnBuilder", "DeepCompileBuilder", "CCLCommBuilder",
           "ShareMemCommBuilder", "NotImplementedBuilder"]


class OpNotBuiltError(RuntimeError):
    """An op builder was asked to build or load its native extension: zeroshard has none."""


class OpBuilder:
    """One DeepSpeed op: its ``NAME``, whether zeroshard provides what it is for, and what it uses instead."""

    NAME = ""
    BUILD_VAR = ""
    #: what zeroshard uses where DeepSpeed would load this op (None: nothing; the op is not provided)
    INSTEAD: Optional[str] = None

    def __init__(self, name: Optional[str] = None) -> None:
        self.name = self.NAME if name is None else name

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether zeroshard provides what this op is for (it never needs the op built)."""
        return self.INSTEAD is not None

    def _refuse(self) -> OpNotBuiltError:
        if self.INSTEAD is None:
            return OpNotBuiltError(f"DeepSpeed op {self.name!r} ({type(self).__name__}): zeroshard builds no native "
                                   f"ops and has no counterpart of this one")
        return OpNotBuiltError(f"DeepSpeed op {self.name!r} ({type(self).__name__}): zeroshard builds no native "
                               f"ops; it uses {self.INSTEAD} instead")

    def load(self, verbose: bool = True) -> Any:
        raise self._refuse()

    def jit_load(self, verbose: bool = True) -> Any:
        raise self._refuse()

    def builder(self) -> Any:
        raise self._refuse()

    def sources(self) -> list[str]:
        return []

    def include_paths(self) -> list[str]:
        return []


_ADAM = "torch.optim.Adam/AdamW(fused=True), as zeroshard.ops.adam.{}"


class CPUAdamBuilder(OpBuilder):
    NAME, BUILD_VAR = "cpu_adam", "DS_BUILD_CPU_ADAM"
    INSTEAD = _ADAM.format("DeepSpeedCPUAdam") + ", stepped on the host under offload_optimizer"


class FusedAdamBuilder(OpBuilder):
    NAME, BUILD_VAR = "fused_adam", "DS_BUILD_FUSED_ADAM"
    INSTEAD = _ADAM.format("FusedAdam")


class CPUAdagradBuilder(OpBuilder):
    NAME, BUILD_VAR = "cpu_adagrad", "DS_BUILD_CPU_ADAGRAD"
    INSTEAD = "torch.optim.Adagrad(foreach=True), passed to initialize(optimizer=...)"


class CPULionBuilder(OpBuilder):
    NAME, BUILD_VAR = "cpu_lion", "DS_BUILD_CPU_LION"


class FusedLambBuilder(OpBuilder):
    NAME, BUILD_VAR = "fused_lamb", "DS_BUILD_FUSED_LAMB"


class FusedLionBuilder(OpBuilder):
    NAME, BUILD_VAR = "fused_lion", "DS_BUILD_FUSED_LION"


class AsyncIOBuilder(OpBuilder):
    NAME, BUILD_VAR = "async_io", "DS_BUILD_AIO"
    INSTEAD: Optional[str] = "its own swap files (pread/pwrite on a background thread) for NVMe offload"


class GDSBuilder(AsyncIOBuilder):
    NAME, BUILD_VAR = "gds", "DS_BUILD_GDS"
    INSTEAD = None


class PinMemoryBuilder(OpBuilder):
    NAME, BUILD_VAR = "pin_memory", "DS_BUILD_PIN_MEMORY"
    INSTEAD = "torch's page-locked allocations (torch.empty(..., pin_memory=True), Tensor.pin_memory())"


class UtilsBuilder(OpBuilder):
    NAME, BUILD_VAR = "utils", "DS_BUILD_UTILS"
    INSTEAD = "torch._utils._flatten_dense_tensors / _unflatten_dense_tensors"


class TransformerBuilder(OpBuilder):
    NAME, BUILD_VAR = "transformer", "DS_BUILD_TRANSFORMER"


class StochasticTransformerBuilder(TransformerBuilder):
    NAME, BUILD_VAR = "stochastic_transformer", "DS_BUILD_STOCHASTIC_TRANSFORMER"


class InferenceBuilder(OpBuilder):
    NAME, BUILD_VAR = "transformer_inference", "DS_BUILD_TRANSFORMER_INFERENCE"


class InferenceCoreBuilder(OpBuilder):
    NAME, BUILD_VAR = "inference_core_ops", "DS_BUILD_INFERENCE_CORE_OPS"


class InferenceCutlassBuilder(OpBuilder):
    NAME, BUILD_VAR = "cutlass_ops", "DS_BUILD_CUTLASS_OPS"


class RaggedOpsBuilder(OpBuilder):
    NAME, BUILD_VAR = "ragged_device_ops", "DS_BUILD_RAGGED_DEVICE_OPS"


class RaggedUtilsBuilder(OpBuilder):
    NAME, BUILD_VAR = "ragged_ops", "DS_BUILD_RAGGED_OPS"


class QuantizerBuilder(OpBuilder):
    NAME, BUILD_VAR = "quantizer", "DS_BUILD_QUANTIZER"


class FPQuantizerBuilder(OpBuilder):
    NAME, BUILD_VAR = "fp_quantizer", "DS_BUILD_FP_QUANTIZER"


class RandomLTDBuilder(OpBuilder):
    NAME, BUILD_VAR = "random_ltd", "DS_BUILD_RANDOM_LTD"


class SpatialInferenceBuilder(OpBuilder):
    NAME, BUILD_VAR = "spatial_inference", "DS_BUILD_SPATIAL_INFERENCE"


class EvoformerAttnBuilder(OpBuilder):
    NAME, BUILD_VAR = "evoformer_attn", "DS_BUILD_EVOFORMER_ATTN"


class DeepCompileBuilder(OpBuilder):
    NAME, BUILD_VAR = "dc", "DS_BUILD_DEEP_COMPILE"


class CCLCommBuilder(OpBuilder):
    NAME, BUILD_VAR = "deepspeed_ccl_comm", "DS_BUILD_CCL_COMM"


class ShareMemCommBuilder(OpBuilder):
    NAME, BUILD_VAR = "deepspeed_shm_comm", "DS_BUILD_SHM_COMM"


class NotImplementedBuilder(OpBuilder):
    NAME, BUILD_VAR = "deepspeed_not_implemented", "DS_BUILD_NOT_IMPLEMENTED"


#: every op's ``NAME`` -> its builder
ALL_OPS: dict[str, OpBuilder] = {b.NAME: b() for b in (
    CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedAdamBuilder, FusedLambBuilder, FusedLionBuilder,
    AsyncIOBuilder, GDSBuilder, PinMemoryBuilder, UtilsBuilder, TransformerBuilder, StochasticTransformerBuilder,
    InferenceBuilder, InferenceCoreBuilder, InferenceCutlassBuilder, RaggedOpsBuilder, RaggedUtilsBuilder,
    QuantizerBuilder, FPQuantizerBuilder, RandomLTDBuilder, SpatialInferenceBuilder, EvoformerAttnBuilder,
    DeepCompileBuilder, CCLCommBuilder, ShareMemCommBuilder, NotImplementedBuilder)}


def compatible_ops() -> dict[str, bool]:
    """Each op's ``NAME`` -> ``is_compatible()`` (DeepSpeed's ``deepspeed.ops.__compatible_ops__``)."""
    return {name: builder.is_compatible() for name, builder in ALL_OPS.items()}
