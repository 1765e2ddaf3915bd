"""What FP8 layers do not compose with, refused by name on every rank before anything is built."""

from __future__ import annotations

from torch import nn

from ..errors import refuse

__all__ = ["refuse_fp8_with", "refuse_fsdp_float8_weights"]

#: torchao's weight subclass for FSDP2's FP8 all-gathers (``enable_fsdp_float8_all_gather``)
FSDP_FLOAT8_WEIGHT = "WeightWithDynamicFloat8CastTensor"


def refuse_fp8_with(tensor_parallel: int) -> None:
    """Refuse FP8 beside tensor parallelism (its layers are split linears that torchao's layer is not), in a
    pipeline's stages too."""
    if tensor_parallel > 1:
        refuse("'fp8.enabled' with tensor parallelism", f"the tensor-parallel degree is {tensor_parallel}, and the "
               "split linear layers are not FP8 layers", "Turn 'fp8.enabled' off, or train without tensor "
               "parallelism.")


def refuse_fsdp_float8_weights(model: nn.Module) -> None:
    """Refuse a model whose FP8 layers hold torchao's FSDP2 weight subclass: Hugging Face Accelerate's FP8
    path (``mixed_precision="fp8"`` with torchao) converts with ``enable_fsdp_float8_all_gather`` by default,
    which makes new parameter objects that the optimizer it hands over does not hold, and whose gathers are
    FSDP2's.  Without that flag Accelerate's conversion trains on zeroshard as any ``Float8Linear`` does."""
    for name, param in model.named_parameters():
        if any(cls.__name__ == FSDP_FLOAT8_WEIGHT for cls in type(param).__mro__):
            refuse(f"torchao's FSDP2 FP8 weight ({name} is a {FSDP_FLOAT8_WEIGHT}: enable_fsdp_float8_all_gather, "
                   f"the default of Accelerate's AORecipeKwargs)", "its all-gathers are FSDP2's, and its parameters "
                   "are not the ones the optimizer holds", "Convert with enable_fsdp_float8_all_gather=False "
                   "(AORecipeKwargs(enable_fsdp_float8_all_gather=False), or "
                   "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER=false), or use zeroshard's 'fp8' config block, whose stage 3 gathers weights in FP8 itself.")
