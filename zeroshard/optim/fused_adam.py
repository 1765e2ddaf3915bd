"""DeepSpeed's Adam classes, ``FusedAdam`` and ``DeepSpeedCPUAdam``, as torch's fused Adam/AdamW.

DeepSpeed ships its own CUDA and AVX kernels; zeroshard uses torch's fused kernel, which exists for
CPU and CUDA and is several times faster than the foreach kernel on CPU (benchmarks/RESULTS.md, section
"Offload", paragraph "torch's fused Adam kernel against its foreach kernel").  Both classes take
DeepSpeed's arguments: ``adam_w_mode=True`` (the default) is decoupled weight decay (AdamW),
``adam_w_mode=False`` is Adam's L2 penalty.  They live here, not only under ``deepspeed.ops.adam``,
because the config's ``Adam``/``AdamW`` builds them as DeepSpeed does (optim/builder.py).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad)``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        if not bias_correction:
            raise ValueError("FusedAdam(bias_correction=False) is not supported: torch's Adam always "
                             "corrects the bias")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         fused=True, decoupled_weight_decay=adam_w_mode)
        del set_grad_none  # zero_grad() sets gradients to None, as set_grad_none=True asks


class DeepSpeedCPUAdam(FusedAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay,
    amsgrad, adamw_mode, fp32_optimizer_states)``: the same fused update (it runs where the
    parameters are: on the host under ``offload_optimizer: cpu``)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported: zeroshard keeps "
                             "optimizer state in fp32")
        super().__init__(model_params, lr, bias_correction, betas, eps, adamw_mode, weight_decay, amsgrad)
