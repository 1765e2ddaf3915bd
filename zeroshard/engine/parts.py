"""The parts an engine is built with beyond its config and world, chosen once from the job's axes.

[Note: an engine composed of parts]
What differs between a plain data-parallel engine, a tensor-parallel rank's, an expert-parallel one's and
a pipeline stage's is not how it steps but two questions about the job: the norm of whose gradients
clipping and overflow detection read (this rank's model over its shard group, the experts summed over
their group, the split parameters over the tensor-parallel group, the stages summed over the
pipeline), and where this rank's model is a slice of a larger one in a checkpoint (a tensor-parallel
rank's part, its split tensors, the directory of its part).  Each answer is a part, chosen once from
the axes when the engine is built (:class:`EngineParts`) and composed, never a subclass overriding a
hook of the engine: a pipeline stage with tensor parallelism is the tensor-parallel parts with the
pipeline's norm across stages on top, the same code as a tensor-parallel model's
(tensor_parallel/norm.py, tensor_parallel/slices.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence, Union

import torch

from ..distributed.collectives import Collectives
from ..optim.clipping import ExpertsNorm, global_grad_norm

if TYPE_CHECKING:
    from ..sharding import ShardingStrategy
    from ..distributed.topology import ShardGroups

#: where zeroshard split the model over a tensor-parallel group: (this rank's index, the group's size,
#: each split parameter's dimension by its name in the checkpoint) (``CheckpointParts.tensor_slice``)
TensorSliceSpec = tuple[int, int, dict[str, int]]

#: this rank's full state dict -> the whole model's; every rank calls it, the second argument says
#: whether this rank keeps the result
WholeModel = Callable[[dict[str, torch.Tensor], bool], dict[str, torch.Tensor]]

PathLike = Union[str, Path]


class GradientNorm(Protocol):
    """The norm of the gradients of this rank's model (one per bucket, its owned chunks),
    ``shard_comm``: summed over the shard group where the chunks are ZeRO shards; a float64 tensor of
    one element on the device."""

    def __call__(self, grads: Sequence[torch.Tensor], shard_comm: Optional[Collectives]) -> torch.Tensor: ...


class NormAcross(Protocol):
    """The norm of this rank's model -> the norm of the whole job's (a pipeline's stages)."""

    def __call__(self, norm: torch.Tensor) -> torch.Tensor: ...


#: builds the engine's norm over its strategy's buckets, on its device
NormBuilder = Callable[["ShardingStrategy", torch.device], GradientNorm]


@dataclass(frozen=True)
class ShardNorm:
    """The norm of a model each rank holds whole but for its shards (optim/clipping.py); with expert
    parallelism at stage 0, the experts' squares summed over the ranks holding the other experts."""

    device: torch.device
    experts: Optional[ExpertsNorm] = None

    @staticmethod
    def over(strategy: "ShardingStrategy", groups: "ShardGroups", device: torch.device) -> "ShardNorm":
        experts = ExpertsNorm(frozenset(b.index for b in strategy.layout.buckets if b.experts),
                              groups.expert_parallel) if groups.expert_parallel is not None else None
        return ShardNorm(device, experts)

    def __call__(self, grads: Sequence[torch.Tensor], shard_comm: Optional[Collectives]) -> torch.Tensor:
        return global_grad_norm(grads, shard_comm, self.device, self.experts)


@dataclass(frozen=True)
class JobNorm:
    """The engine's norm part: its model's norm, then (a pipeline) the norm across the rest of the job."""

    model: GradientNorm
    across: Optional[NormAcross] = None

    def __call__(self, grads: Sequence[torch.Tensor], shard_comm: Optional[Collectives]) -> torch.Tensor:
        norm = self.model(grads, shard_comm)
        return norm if self.across is None else self.across(norm)


class ModelSlice(Protocol):
    """Where this rank's model is a slice of a larger one, as checkpoints and full weights see it."""

    def tensor_slice(self) -> Optional[TensorSliceSpec]:
        """Where zeroshard split the model: a load cuts each saved parameter to this rank's part."""

    def whole_model(self) -> Optional[WholeModel]:
        """How this rank's full state dict becomes the whole model's (None: it is already)."""

    def own_directory(self, directory: PathLike) -> PathLike:
        """Where this rank's checkpoints are in ``directory``."""

    def save_directory(self, save_dir: PathLike) -> PathLike:
        """Where ``save_checkpoint(save_dir)`` writes this rank's checkpoint (recording the split first)."""

    def load_directory(self, load_dir: PathLike) -> PathLike:
        """Where ``load_checkpoint(load_dir)`` reads this rank's checkpoint (checked first)."""

    def check_full_weights(self) -> None:
        """Raise where one file of full weights cannot be made from the ranks' parts."""


class WholeModelHere:
    """The model is whole on this rank (experts spread over ranks aside, which the engine gathers itself)."""

    def tensor_slice(self) -> Optional[TensorSliceSpec]:
        return None

    def whole_model(self) -> Optional[WholeModel]:
        return None

    def own_directory(self, directory: PathLike) -> PathLike:
        return directory

    def save_directory(self, save_dir: PathLike) -> PathLike:
        return save_dir

    def load_directory(self, load_dir: PathLike) -> PathLike:
        return load_dir

    def check_full_weights(self) -> None:
        return None


@dataclass(frozen=True)
class EngineParts:
    """What an engine is built with beyond its config and world (see [Note: an engine composed of parts])."""

    #: where this rank's model is a slice of a larger one
    model_slice: ModelSlice = WholeModelHere()
    #: the norm of this rank's model (None: :class:`ShardNorm`, over the strategy and its groups)
    norm: Optional[NormBuilder] = None
    #: the norm across the rest of the job (a pipeline's stages)
    norm_across: Optional[NormAcross] = None
    #: whether the engine's optimizer steps make the config's periodic saves
    saves_periodically: bool = True

    def grad_norm(self, strategy: "ShardingStrategy", groups: "ShardGroups", device: torch.device) -> JobNorm:
        model = self.norm(strategy, device) if self.norm is not None else ShardNorm.over(strategy, groups, device)
        return JobNorm(model, self.norm_across)


class ExtraNames(Protocol):
    """A facade that answers the names an engine does not define (see [Note: DeepSpeed's names on the
    engine] in engine/engine.py)."""

    def answer(self, name: str) -> Any: ...


#: builds the facade over a (weak proxy of the) engine; set by :func:`register_extra_names`
_EXTRA_NAMES: list[Callable[[Any], ExtraNames]] = []


def register_extra_names(facade: Callable[[Any], ExtraNames]) -> None:
    """Every engine built from now on answers the names it does not define with ``facade(engine)``
    (zeroshard/deepspeed/engine_api.py registers DeepSpeed's accessors when it is imported, which
    ``import zeroshard`` always does)."""
    _EXTRA_NAMES[:] = [facade]


def extra_names_of(engine: Any) -> Optional[ExtraNames]:
    """The registered facade over ``engine`` (None where none is registered)."""
    return _EXTRA_NAMES[0](engine) if _EXTRA_NAMES else None
