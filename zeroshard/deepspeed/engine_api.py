"""The engine's DeepSpeed-shaped face: the accessors DeepSpeed scripts, Hugging Face and Accelerate call.

[Note: one thin layer for DeepSpeed's names]
zeroshard's engine is written in its own terms (a world, a precision policy, a sharding strategy);
DeepSpeed's users reach it through DeepSpeed's names (``engine.fp16_enabled()``, ``engine.local_rank``,
``engine.zero_optimization_stage()``, any module attribute through the engine).  Those names live
here, in :class:`DeepSpeedEngineAPI`, a part of every engine, each one a one-line reading of the few
public things of the engine that :class:`EngineView` lists, so that the engine itself never grows
DeepSpeed's vocabulary and every DeepSpeed name zeroshard provides can be found in one place.  The
engine answers a name it does not define with :meth:`DeepSpeedEngineAPI.answer` (see [Note: DeepSpeed's
names on the engine] in engine/engine.py): this module registers the class as the engine's facade of
extra names when it is imported (``zeroshard/deepspeed/__init__.py`` imports it, and ``import
zeroshard`` imports that package), so the engine imports nothing of zeroshard/deepspeed.  DeepSpeed's
names that the engine's own code calls, or that read its private state (``train_batch_size()``,
``get_lr()``, ``get_global_grad_norm()``, the checkpoint methods, ...), are the engine's own methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Protocol

import torch
from torch import nn

from ..checkpoint.background import wait_for_copies
from ..checkpoint.utils import make_executable
from ..engine.parts import register_extra_names
from ..sharding.stage3.gathered import GatheredParameters
from .refused import refuse

if TYPE_CHECKING:  # only for the types below
    from ..config import ZeroshardConfig
    from ..distributed.world import World
    from ..precision import PrecisionPolicy


class EngineView(Protocol):
    """What DeepSpeed's accessors read from the engine: public parts and methods, nothing else."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def world(self) -> "World": ...

    @property
    def config(self) -> "ZeroshardConfig": ...

    @property
    def precision(self) -> "PrecisionPolicy": ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def stage(self) -> int: ...

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]: ...

    def close(self) -> None: ...


class DeepSpeedEngineAPI:
    """DeepSpeed's engine accessors over an :class:`EngineView` (the engine answers them by name)."""

    def __init__(self, engine: EngineView) -> None:
        self._engine = engine

    def answer(self, name: str) -> Any:
        """``engine.<name>`` for a name the engine does not define: DeepSpeed's accessor of that name,
        else the wrapped module's attribute (``engine.config`` aside, as in DeepSpeed: e.g.
        ``engine.generate(...)``, ``engine.gradient_checkpointing_enable()``)."""
        if name in ACCESSORS:
            return getattr(self, name)
        module = self._engine.module
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"neither the engine nor its module ({type(module).__name__}) has an "
                                 f"attribute {name!r}") from None

    # ------------------------------------------------------------------ where and who
    @property
    def device(self) -> torch.device:
        """The device this rank trains on (``cuda:local_rank``, or the CPU)."""
        return self._engine.world.device

    @property
    def local_rank(self) -> int:
        return self._engine.world.local_rank

    @property
    def global_rank(self) -> int:
        return self._engine.world.rank

    @property
    def world_size(self) -> int:
        return self._engine.world.world_size

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks: every rank (zeroshard has no model parallelism)."""
        return self._engine.world.world_size

    # ------------------------------------------------------------------ what the config chose
    def fp16_enabled(self) -> bool:
        return self._engine.precision.compute == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self._engine.precision.compute == torch.bfloat16

    def zero_optimization(self) -> bool:
        return self._engine.stage > 0

    def zero_optimization_stage(self) -> int:
        return self._engine.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self._engine.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self._engine.stage == 3

    def zero_offload_optimizer(self) -> bool:
        return self._engine.config.zero_optimization.offload_optimizer.device != "none"

    def zero_offload_param(self) -> bool:
        return self._engine.config.zero_optimization.offload_param.device != "none"

    def zero_quantized_weights(self) -> bool:
        return self._engine.config.zero_optimization.zero_quantized_weights

    def zero_quantized_nontrainable_weights(self) -> bool:
        return self._engine.config.zero_optimization.zero_quantized_nontrainable_weights

    def zero_quantized_gradients(self) -> bool:
        return self._engine.config.zero_optimization.zero_quantized_gradients

    def gradient_clipping(self) -> float:
        return self._engine.config.gradient_clipping

    def steps_per_print(self) -> float:
        return self._engine.config.steps_per_print

    def was_step_applied(self) -> bool:
        """False when the last optimizer step was skipped (fp16 overflow)."""
        return not getattr(self._engine.optimizer, "overflow", False)

    # ------------------------------------------------------------------ the module, through the engine
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self._engine.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self._engine.module.named_parameters(*args, **kwargs)

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        return self._engine.module.named_modules(*args, **kwargs)

    def modules(self) -> Iterator[nn.Module]:
        return self._engine.module.modules()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict, as DeepSpeed's ``engine.state_dict()`` gives it (at stage
        3 released parameters show without values: use ``engine.full_state_dict()`` for the weights)."""
        return self._engine.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load full weights into the wrapped module; every rank passes the same ``state_dict``.

        At stage 3 the parameters are gathered for the load and rank 0's values written into every
        rank's shard (peak: the whole model gathered once).
        """
        wait_for_copies()  # see [Note: asynchronous saves] in checkpoint/background.py
        module = self._engine.module
        if self._engine.stage < 3:
            return module.load_state_dict(state_dict, strict=strict)
        with GatheredParameters(list(module.parameters()), modifier_rank=0):
            return module.load_state_dict(state_dict, strict=strict)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict[str, torch.Tensor]:
        """Full weights in the training dtype on rank 0 (an empty dict elsewhere); every rank calls it.

        Hugging Face's ``Trainer.save_model`` and Accelerate's ``get_state_dict`` use it at stage 3.
        """
        state = self._engine.full_state_dict(rank0_only=True)
        dtype = self._engine.precision.compute
        frozen = {n for n, p in self._engine.module.named_parameters() if not p.requires_grad} \
            if exclude_frozen_parameters else set()
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items() if k not in frozen}

    def destroy(self) -> None:
        """DeepSpeed's name for releasing the engine (Accelerate's ``free_memory()`` calls it)."""
        self._engine.close()

    def _change_recovery_script_permissions(self, dst: str) -> None:
        """DeepSpeed's step making the recovery script beside a checkpoint executable, where the file
        system allows it (a refusal or a missing file is logged, not raised)."""
        make_executable(dst)

    def offload_states(self, *args: Any, **kwargs: Any) -> None:
        """DeepSpeed's temporary move of the engine's states off the device (between RLHF phases)."""
        refuse("engine.offload_states()", "zeroshard places states once, from the config",
               "Use zero_optimization.offload_optimizer / offload_param to keep them off the device.")

    def reload_states(self, *args: Any, **kwargs: Any) -> None:
        refuse("engine.reload_states()", "zeroshard has no offload_states()",
               "Use zero_optimization.offload_optimizer / offload_param to keep states off the device.")


#: the names the engine answers from :class:`DeepSpeedEngineAPI` (any other name it lacks is the module's)
ACCESSORS = frozenset(name for name in vars(DeepSpeedEngineAPI) if not name.startswith("__")) - {"answer"}

register_extra_names(DeepSpeedEngineAPI)
