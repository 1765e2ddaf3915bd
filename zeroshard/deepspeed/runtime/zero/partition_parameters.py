"""``deepspeed.runtime.zero.partition_parameters`` (and ``deepspeed.zero``): ``Init``,
``GatheredParameters``, ``ZeroParamStatus``, external parameters, the tensor-constructor wrapper,
``CUDAQuantizer`` (ZeRO++'s int8 quantiser under DeepSpeed's name).

The machinery is zeroshard's own (:mod:`zeroshard.sharding.stage3.init_context`,
:mod:`zeroshard.sharding.stage3.gathered`, :mod:`zeroshard.sharding.stage3.units`); this module only
speaks DeepSpeed's signatures over it.  The signatures live here, at DeepSpeed's module path, and not
in a module that re-exports them, because Hugging Face patches names *in this module*
(``zero_wrapper_for_fp_tensor_constructor`` around ``zero.Init``), and the patch must reach the code
that uses them.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...accelerator import get_accelerator
from ....sharding.stage3.gathered import GatheredParameters
from ....sharding.stage3.init_context import Init as _Init
from ....sharding.stage3.param_status import ZeroParamStatus
from ....quantize import dequantise_groups, group_count, quantise_groups
from ....sharding.stage3.units import register_external_parameter, unregister_external_parameter

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter", "zero_wrapper_for_fp_tensor_constructor", "get_accelerator",
           "CUDAQuantizer"]

# The floating-point tensor constructors Init(dtype=...) wraps, and torch's originals.
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_CONSTRUCTORS = {"empty": _orig_torch_empty, "zeros": _orig_torch_zeros, "ones": _orig_torch_ones,
                 "full": _orig_torch_full, "arange": _orig_torch_arange}


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype,
                                           target_device: Optional[torch.device] = None) -> Callable[..., torch.Tensor]:
    """``fn`` (a torch constructor) making floating-point tensors in ``target_fp_dtype`` unless the call
    names a dtype, on ``target_device`` unless it names a device.  ``Init(dtype=...)`` installs these
    for the duration of its block; code may replace this function before entering it (Hugging Face
    does, to keep ``torch.arange`` in the dtype a RoPE buffer asks for)."""
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if kwargs.get("dtype") is None and tensor.is_floating_point():
            tensor = tensor.to(target_fp_dtype)
        return tensor

    return wrapped


class Init(_Init):
    """``deepspeed.zero.Init`` with DeepSpeed's keywords, over :class:`zeroshard.Init`.

    - ``config_dict_or_path`` / ``config``: the DeepSpeed config (its collective timeout is used;
      Hugging Face passes the training config, ``"auto"`` values included).
    - ``dtype``: the dtype floating-point parameters are built in (default: as the model makes them;
      zeroshard's masters start from those unrounded values).
    - ``remote_device`` ``"cpu"`` keeps the shards in host memory until ``initialize()``.
    - ``data_parallel_group`` must be the whole world and ``mpu`` None: zeroshard has no model
      parallelism; ``module=`` (partitioning an existing model) is refused: build the model inside the
      block, or pass it to ``initialize()`` at stage 3, which shards it there.
    """

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None,
                 pin_memory: bool = False, config_dict_or_path: Any = None, config: Any = None,
                 enabled: bool = True, dtype: Optional[torch.dtype] = None, mpu: Any = None,
                 **unsupported: Any) -> None:
        refused = {k: v for k, v in unsupported.items() if v not in (None, False)}
        if refused:
            raise ValueError(f"zeroshard.deepspeed.zero.Init does not support {sorted(refused)} (they need model, "
                             f"sequence or quantized parallelism, which zeroshard does not have)")
        if module is not None:
            raise ValueError("zeroshard.deepspeed.zero.Init(module=...) is not supported: build the model inside "
                             "`with zeroshard.deepspeed.zero.Init():`, or pass it to initialize() at stage 3, which "
                             "shards it there")
        if mpu is not None:
            raise ValueError("zeroshard.deepspeed.zero.Init(mpu=...): zeroshard has no model parallelism; pass mpu=None")
        if data_parallel_group not in (None, dist.group.WORLD):
            raise ValueError("zeroshard.deepspeed.zero.Init(data_parallel_group=...): zeroshard shards over the whole "
                             "world; pass None or torch.distributed.group.WORLD")
        if remote_device not in (None, "none", "cpu"):
            raise ValueError(f"zeroshard.deepspeed.zero.Init(remote_device={remote_device!r}): 'cpu' or None (NVMe "
                             f"parameter offload is configured with zero_optimization.offload_param)")
        super().__init__(config_dict_or_path if config_dict_or_path is not None else config, enabled=enabled,
                         dtype=dtype, shard_device=torch.device("cpu") if remote_device == "cpu" else None)
        # mem_efficient_linear and pin_memory: accepted, with no meaning here (zeroshard computes with
        # torch's own linear; host memory is pinned as offload_param.pin_memory says)
        del mem_efficient_linear, pin_memory
        self._replaced: dict[str, Any] = {}

    def __enter__(self) -> "Init":
        """With ``dtype``, floating-point constructors inside the block make tensors in it (buffers too)."""
        if self.enabled and self.dtype is not None:
            wrap = sys.modules[__name__].zero_wrapper_for_fp_tensor_constructor  # as patched, if it was
            for name, original in _CONSTRUCTORS.items():
                self._replaced[name] = getattr(torch, name)
                setattr(torch, name, wrap(original, self.dtype, target_device=self.world.device))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, previous in self._replaced.items():
            setattr(torch, name, previous)
        self._replaced.clear()
        super().__exit__(*exc)


class CUDAQuantizer:
    """DeepSpeed's ZeRO++ weight quantiser: a tensor as int8 values with one fp32 scale per group, and
    back in the dtype asked for.

    zeroshard builds no DeepSpeed ops, so by default it quantises with its own block quantiser
    (``zeroshard.quantize.quantise_groups``: symmetric, equal groups, on any device; [Note: equal groups]
    in quantize/groups.py).  Where ``quantizer_cuda_module`` is set to DeepSpeed's compiled quantizer op,
    that op is used with its convention: it reads fp16 and writes fp16, so the values are handed to it in
    fp16 and come back in the dtype asked for, never reinterpreted.
    """

    #: DeepSpeed's compiled quantizer op (``quantize`` / ``dequantize`` / ``Symmetric``), or None
    quantizer_cuda_module: Any = None

    def quantize(self, param: torch.Tensor, groups: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 values, fp32 scales: one per group; ``groups`` None: groups of at most 8000 elements)."""
        op = type(self).quantizer_cuda_module
        if op is None:
            return quantise_groups(param, groups)
        values = param.to(dtype=torch.half)
        count = group_count(values.numel()) if groups is None else groups
        result: tuple[torch.Tensor, torch.Tensor] = op.quantize(values, count, 8, op.Symmetric)
        return result

    def dequantize(self, quantized_param: torch.Tensor, scale: torch.Tensor,
                   dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The values back (flat), in ``dtype`` (None: fp16, as DeepSpeed's op writes)."""
        op = type(self).quantizer_cuda_module
        if op is None:
            return dequantise_groups(quantized_param, scale, dtype or torch.half)
        values: torch.Tensor = op.dequantize(quantized_param, scale, scale.numel(), 8, op.Symmetric)
        return values if dtype is None else values.to(dtype)
