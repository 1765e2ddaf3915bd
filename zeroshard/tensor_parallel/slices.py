"""A tensor-parallel rank's slice of the model, as checkpoints and full weights see it (an engine part:
``ModelSlice`` in engine/parts.py).

[Note: ZeRO under a model's own tensor parallelism]
A model that splits its layers across ranks itself (Megatron's layers, with an ``mpu``) trains each
tensor-parallel rank's part as an ordinary model: the engine of that rank shards, averages and
updates its part over the rank's data-parallel group only, at any ZeRO stage, and the model's
forward and backward do the tensor-parallel communication.  Two things see the whole model, each an
engine part built from the rank's :class:`TensorAxis`: the gradient norm that clipping and overflow
detection read (see [Note: split and replicated parameters in the norm] in tensor_parallel/norm.py),
and checkpoints (:class:`TensorSlice`), where each tensor-parallel rank's part is a checkpoint of its
own under ``mp_rank_XX`` of the directory, as DeepSpeed names its model-parallel files; each part's
``latest`` is its own, and they agree because every rank saves at the same calls.  A checkpoint loads
at the tensor-parallel degree it was saved at (any data-parallel degree and ZeRO stage, as any
zeroshard checkpoint); re-splitting a model's own parts for another degree is the model's layout to
know, and is refused.  Where zeroshard split the model (``tensor_parallel.autotp_size``, a pipeline's
stages) it knows the layout, and a checkpoint loads at any degree (see [Note: a tensor-parallel
checkpoint read at another size] in checkpoint/tensor_parts.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..checkpoint.tensor_parts import part_directory, write_tensor_split
from ..distributed.collectives import Collectives
from ..engine.parts import PathLike, TensorSliceSpec, WholeModel
from .split import SplitModel


class TensorParallelCheckpointError(ValueError):
    """A checkpoint saved at another tensor-parallel degree (or without one), or a save that would
    put every tensor-parallel rank's part in one file."""


def _same_name(name: str) -> str:
    return name


@dataclass(frozen=True)
class TensorAxis:
    """This rank's place on the tensor axis: the group its model's layers are split over."""

    #: the tensor-parallel group
    comm: Collectives
    #: this rank's index in it
    rank: int
    size: int
    #: how zeroshard split the model (``tensor_parallel.autotp_size``, a pipeline's stages); None: the
    #: model splits its own layers (an ``mpu``'s), and its marks say which parameters are split
    split: Optional[SplitModel] = None
    #: a parameter's name in the job's checkpoints (a pipeline stage's: ``PipelineModule.global_name``)
    job_name: Callable[[str], str] = _same_name


class TensorSlice:
    """A tensor-parallel rank's part of the model in checkpoints (see [Note: ZeRO under a model's own
    tensor parallelism])."""

    def __init__(self, axis: TensorAxis) -> None:
        self.axis = axis

    def job_dims(self) -> dict[str, int]:
        """The split parameters' dimensions by their names in the job's checkpoints."""
        split = self.axis.split
        return {} if split is None else {self.axis.job_name(name): dim for name, dim in split.dims.items()}

    def tensor_slice(self) -> Optional[TensorSliceSpec]:
        return None if self.axis.split is None else (self.axis.rank, self.axis.size, self.job_dims())

    def whole_model(self) -> Optional[WholeModel]:
        """Where zeroshard split the model: every split tensor gathered whole from the tensor-parallel
        group (``full_state_dict()``, ``save_16bit_model()``); a model that splits itself is its own to join."""
        split = self.axis.split
        if split is None:
            return None
        tensor = self.axis.comm

        def whole(state: dict[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor]:
            out = {}
            for name, value in state.items():
                dim = split.dims.get(name)
                if dim is not None and tensor.world.is_distributed:
                    every = torch.empty(tensor.world.world_size * value.numel(), dtype=value.dtype,
                                        device=tensor.world.device)
                    tensor.all_gather(every, value.to(every.device).reshape(-1), f"whole_tensor.{name}")
                    value = torch.cat(list(every.view(tensor.world.world_size, *value.shape)), dim=dim).cpu()
                out[name] = value
            return out if keep else {}
        return whole

    def own_directory(self, directory: PathLike) -> Path:
        """This rank's part of the checkpoint directory ``directory``."""
        return Path(directory) / part_directory(self.axis.rank)

    def record_split(self, save_dir: Path, dims: Optional[dict[str, int]] = None) -> None:
        """Where zeroshard split the model: how it split it (``dims``, default this rank's), beside the
        parts (``tensor_split.json``: [Note: a tensor-parallel checkpoint read at another size] in
        checkpoint/tensor_parts.py), written by the job's first rank."""
        if self.axis.split is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            write_tensor_split(save_dir, self.axis.size, self.job_dims() if dims is None else dims)

    def save_directory(self, save_dir: PathLike) -> Path:
        """This tensor-parallel rank's part, under ``save_dir/mp_rank_XX`` (every rank saves), with how
        zeroshard split the model beside the parts."""
        self.record_split(Path(save_dir))
        return self.own_directory(save_dir)

    def load_directory(self, load_dir: PathLike) -> PathLike:
        """This rank's part of a checkpoint saved at the same tensor-parallel degree; where zeroshard split
        the model, also one saved at another degree, or without tensor parallelism, re-split by name."""
        if self.axis.split is not None and not self._same_degree(Path(load_dir)):
            return load_dir
        self._check_degree(Path(load_dir))
        return self.own_directory(load_dir)

    def _saved_parts(self, load_dir: Path) -> list[str]:
        return sorted(p.name for p in load_dir.glob("mp_rank_*") if p.is_dir())

    def _same_degree(self, load_dir: Path) -> bool:
        saved = self._saved_parts(load_dir) if load_dir.is_dir() else []
        return saved == [part_directory(r) for r in range(self.axis.size)]

    def _check_degree(self, load_dir: Path) -> None:
        if not load_dir.is_dir():
            return  # the checkpointer names a missing directory
        saved = self._saved_parts(load_dir)
        if saved != [part_directory(r) for r in range(self.axis.size)]:
            found = f"parts {saved}" if saved else "no mp_rank_XX parts (saved without tensor parallelism)"
            raise TensorParallelCheckpointError(
                f"load_checkpoint({str(load_dir)!r}): {found}, but this job is tensor parallel "
                f"{self.axis.size}; a checkpoint loads at the tensor-parallel degree it was saved at")

    def check_full_weights(self) -> None:
        """Where zeroshard split the model, the whole model's weights are its split tensors joined; a
        model that splits itself is refused."""
        if self.axis.split is None:
            raise TensorParallelCheckpointError(
                "save_16bit_model(): each tensor-parallel rank holds part of the model, and one file of full "
                "weights would need them joined, which depends on the model's layers; use save_checkpoint()")

    def release_at_exit(self) -> None:
        """The tensor-parallel group is dropped at exit (see [Note: a clean exit] in distributed/world.py)."""
        self.axis.comm.world = dataclasses.replace(self.axis.comm.world, group=None)
