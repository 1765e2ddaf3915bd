"""The engine's DeepSpeed-shaped face: the accessors DeepSpeed scripts, Hugging Face and Accelerate call.

[Note: one thin layer for DeepSpeed's names]
zeroshard's engine is written in its own terms (a world, a precision policy, a sharding strategy);
DeepSpeed's users reach it through DeepSpeed's names (``engine.fp16_enabled()``, ``engine.local_rank``,
``engine.zero_optimization_stage()``, any module attribute through the engine).  Those names live
here, as a mixin of :class:`~zeroshard.engine.engine.Engine`, each one a one-line reading of zeroshard's own
state, so that the engine itself never grows DeepSpeed's vocabulary and every DeepSpeed name
zeroshard provides can be found in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from ..checkpoint.background import wait_for_copies
from ..sharding.stage3.gathered import GatheredParameters
from .refused import refuse

if TYPE_CHECKING:  # only for the attribute types below; the engine imports this module, not the reverse
    from ..config import ZeroshardConfig
    from ..distributed.world import World
    from ..precision import PrecisionPolicy


class DeepSpeedEngineAPI:
    """DeepSpeed's engine accessors over zeroshard's state (mixed into :class:`Engine`)."""

    module: nn.Module
    world: "World"
    precision: "PrecisionPolicy"
    config: "ZeroshardConfig"
    optimizer: torch.optim.Optimizer

    # ------------------------------------------------------------------ where and who
    @property
    def device(self) -> torch.device:
        """The device this rank trains on (``cuda:local_rank``, or the CPU)."""
        return self.world.device

    @property
    def local_rank(self) -> int:
        return self.world.local_rank

    @property
    def global_rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks: every rank (zeroshard has no model parallelism)."""
        return self.world.world_size

    # ------------------------------------------------------------------ what the config chose
    def fp16_enabled(self) -> bool:
        return self.precision.compute == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.precision.compute == torch.bfloat16

    def zero_optimization(self) -> bool:
        return self.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.stage == 3

    def zero_offload_optimizer(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device != "none"

    def zero_offload_param(self) -> bool:
        return self.config.zero_optimization.offload_param.device != "none"

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> float:
        return self.config.steps_per_print

    def was_step_applied(self) -> bool:
        """False when the last optimizer step was skipped (fp16 overflow)."""
        return not getattr(self.optimizer, "overflow", False)

    @property
    def stage(self) -> int:  # provided by the engine
        raise NotImplementedError

    # ------------------------------------------------------------------ the module, through the engine
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        return self.module.named_modules(*args, **kwargs)

    def modules(self) -> Iterator[nn.Module]:
        return self.module.modules()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict, as DeepSpeed's ``engine.state_dict()`` gives it (at stage
        3 released parameters show without values: use :meth:`full_state_dict` for the weights)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load full weights into the wrapped module; every rank passes the same ``state_dict``.

        At stage 3 the parameters are gathered for the load and rank 0's values written into every
        rank's shard (peak: the whole model gathered once).
        """
        wait_for_copies()  # see [Note: asynchronous saves]
        if self.stage < 3:
            return self.module.load_state_dict(state_dict, strict=strict)
        with GatheredParameters(list(self.module.parameters()), modifier_rank=0):
            return self.module.load_state_dict(state_dict, strict=strict)

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:  # provided by the engine
        raise NotImplementedError

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict[str, torch.Tensor]:
        """Full weights in the training dtype on rank 0 (an empty dict elsewhere); every rank calls it.

        Hugging Face's ``Trainer.save_model`` and Accelerate's ``get_state_dict`` use it at stage 3.
        """
        state = self.full_state_dict(rank0_only=True)
        dtype = self.precision.compute
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad} \
            if exclude_frozen_parameters else set()
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items() if k not in frozen}

    def destroy(self) -> None:
        """DeepSpeed's name for releasing the engine (Accelerate's ``free_memory()`` calls it)."""
        self.close()

    def close(self) -> None:  # provided by the engine
        raise NotImplementedError

    def offload_states(self, *args: Any, **kwargs: Any) -> None:
        """DeepSpeed's temporary move of the engine's states off the device (between RLHF phases)."""
        refuse("engine.offload_states()", "zeroshard places states once, from the config",
               "Use zero_optimization.offload_optimizer / offload_param to keep them off the device.")

    def reload_states(self, *args: Any, **kwargs: Any) -> None:
        refuse("engine.reload_states()", "zeroshard has no offload_states()",
               "Use zero_optimization.offload_optimizer / offload_param to keep states off the device.")

    def __getattr__(self, name: str) -> Any:
        """Anything else is the wrapped module's (``engine.config`` aside, as in DeepSpeed: e.g.
        ``engine.generate(...)``, ``engine.gradient_checkpointing_enable()``)."""
        module = self.__dict__.get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"neither the engine nor its module ({type(module).__name__}) has an "
                                 f"attribute {name!r}") from None
