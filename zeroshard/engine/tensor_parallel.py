"""The engine of one tensor-parallel rank: ZeRO over its data-parallel group, the norm over the model.

[Note: ZeRO under a model's own tensor parallelism]
A model that splits its layers across ranks itself (Megatron's layers, with an ``mpu``) trains each
tensor-parallel rank's part as an ordinary model: the engine of that rank shards, averages and
updates its part over the rank's data-parallel group only, at any ZeRO stage, and the model's
forward and backward do the tensor-parallel communication.  Two things see the whole model: the
gradient norm that clipping and overflow detection read (see [Note: split and replicated parameters
in the norm] in optim/tensor_parallel_norm.py), and checkpoints, where each tensor-parallel rank's
part is a checkpoint of its own under ``mp_rank_XX`` of the directory, as DeepSpeed names its
model-parallel files; each part's ``latest`` is its own, and they agree because every rank saves at
the same calls.  A checkpoint loads at the tensor-parallel degree it was saved at (any data-parallel
degree and ZeRO stage, as any zeroshard checkpoint); re-splitting a model's own parts for another
degree is the model's layout to know, and is refused.  Where zeroshard split the model
(``tensor_parallel.autotp_size``) it knows the layout, and a checkpoint loads at any degree (see [Note:
a tensor-parallel checkpoint read at another size] in checkpoint/tensor_parts.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.tensor_parts import part_directory, write_tensor_split
from ..config import ZeroshardConfig
from ..distributed.collectives import Collectives
from ..distributed.model_parallel import ModelParallelWorlds
from ..optim.tensor_parallel_norm import TensorParallelNorm
from .engine import Engine, SchedulerSpec

if TYPE_CHECKING:
    from ..tensor_parallel import SplitModel


class TensorParallelCheckpointError(ValueError):
    """A checkpoint saved at another tensor-parallel degree (or without one), or a save that would
    put every tensor-parallel rank's part in one file."""


class TensorParallelEngine(Engine):
    """Trains one tensor-parallel rank's part of a model split by its ``mpu`` (see [Note: ZeRO under a
    model's own tensor parallelism])."""

    def __init__(self, model: nn.Module, config: ZeroshardConfig, worlds: ModelParallelWorlds, mpu: Any,
                 model_parameters: Any = None, optimizer: Any = None, lr_scheduler: SchedulerSpec = None,
                 split: Optional["SplitModel"] = None) -> None:
        """``split``: how zeroshard split the model itself (``tensor_parallel.autotp_size``): which
        parameters are split, along which dimension; otherwise the model's marks say which are split."""
        self.mpu = mpu
        self.split = split
        self._held_hooks: list[Any] = []
        self.tensor_rank = worlds.tensor_rank
        self.tensor_parallel_size = worlds.dims.tp
        self.tensor: Collectives = worlds.tensor
        ckpt = config.checkpoint
        if ckpt.save_dir is not None:  # periodic saves of this rank's part
            config = dataclasses.replace(config, checkpoint=dataclasses.replace(
                ckpt, save_dir=str(Path(ckpt.save_dir) / part_directory(self.tensor_rank))))
        super().__init__(model, config, worlds.data_world, model_parameters, optimizer, lr_scheduler, axes=worlds.dims)
        self._norm = TensorParallelNorm(self.strategy.layout.buckets, self.strategy.params, self.tensor,
                                        split.split if split is not None else None)
        if ckpt.save_dir is not None:  # periodic saves: how the model is split, beside its parts
            self._record_split(Path(ckpt.save_dir))

    def _whole_model(self, experts: Any) -> Optional[Callable[[dict[str, torch.Tensor], bool], dict[str, torch.Tensor]]]:
        """Where zeroshard split the model: every split tensor gathered whole from the tensor-parallel
        group (``full_state_dict()``, ``save_16bit_model()``); a model that splits itself is its own to join."""
        split = self.split
        if split is None:
            return None
        tensor = self.tensor

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

    def _tensor_slice(self) -> Optional[tuple[int, int, dict[str, int]]]:
        return None if self.split is None else (self.tensor_rank, self.tensor_parallel_size, dict(self.split.dims))

    def hold_hook(self, handle: Any) -> None:
        """A hook of the tensor-parallel set-up on the model, removed with the engine's own hooks."""
        self._held_hooks.append(handle)

    def _release(self, hand_back: bool) -> None:
        for handle in getattr(self, "_held_hooks", ()):
            handle.remove()
        self._held_hooks = []
        super()._release(hand_back)

    def _model_grad_norm(self, grads: list[torch.Tensor], comm: Optional[Collectives]) -> torch.Tensor:
        return self._norm(grads, comm, self.strategy.comm.world.rank, self.world.device)

    def part_of(self, directory: Union[str, Path]) -> Path:
        """This rank's part of the checkpoint directory ``directory``."""
        return Path(directory) / part_directory(self.tensor_rank)

    def save_checkpoint(self, save_dir: Union[str, Path], tag: Any = None, client_state: Any = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: Optional[bool] = None) -> Path:
        """This tensor-parallel rank's part, under ``save_dir/mp_rank_XX`` (every rank calls it); where
        zeroshard split the model, with how it split it beside the parts (``tensor_split.json``: [Note: a
        tensor-parallel checkpoint read at another size] in checkpoint/tensor_parts.py)."""
        self._record_split(Path(save_dir))
        return super().save_checkpoint(self.part_of(save_dir), tag, client_state, save_latest,
                                       exclude_frozen_parameters, async_save)

    def _record_split(self, save_dir: Path) -> None:
        if self.split is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            write_tensor_split(save_dir, self.tensor_parallel_size, self.split.dims)

    def load_checkpoint(self, load_dir: Union[str, Path], tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, load_rng_state: Optional[bool] = None,
                        ) -> tuple[Optional[Path], Any]:
        """This rank's part of a checkpoint saved at the same tensor-parallel degree; where zeroshard split
        the model, also one saved at another degree, or without tensor parallelism, re-split by name."""
        if self.split is not None and not self._same_degree(Path(load_dir)):
            return super().load_checkpoint(load_dir, tag, load_module_strict, load_optimizer_states,
                                           load_lr_scheduler_states, load_module_only, load_rng_state)
        self._check_degree(Path(load_dir))
        return super().load_checkpoint(self.part_of(load_dir), tag, load_module_strict, load_optimizer_states,
                                       load_lr_scheduler_states, load_module_only, load_rng_state)

    def _same_degree(self, load_dir: Path) -> bool:
        saved = sorted(p.name for p in load_dir.glob("mp_rank_*") if p.is_dir()) if load_dir.is_dir() else []
        return saved == [part_directory(r) for r in range(self.tensor_parallel_size)]

    def _check_degree(self, load_dir: Path) -> None:
        if not load_dir.is_dir():
            return  # the checkpointer names a missing directory
        saved = sorted(p.name for p in load_dir.glob("mp_rank_*") if p.is_dir())
        if saved != [part_directory(r) for r in range(self.tensor_parallel_size)]:
            found = f"parts {saved}" if saved else "no mp_rank_XX parts (saved without tensor parallelism)"
            raise TensorParallelCheckpointError(
                f"load_checkpoint({str(load_dir)!r}): {found}, but this job is tensor parallel "
                f"{self.tensor_parallel_size}; a checkpoint loads at the tensor-parallel degree it was saved at")

    def save_16bit_model(self, save_dir: Union[str, Path], save_filename: str = "model.safetensors",
                         dtype: Optional[torch.dtype] = None, exclude_frozen_parameters: bool = False,
                         ) -> Optional[Path]:
        """Where zeroshard split the model: the whole model's weights (its split tensors joined); a model
        that splits itself is refused."""
        if self.split is not None:
            return super().save_16bit_model(save_dir, save_filename, dtype, exclude_frozen_parameters)
        raise TensorParallelCheckpointError(
            "save_16bit_model(): each tensor-parallel rank holds part of the model, and one file of full "
            "weights would need them joined, which depends on the model's layers; use save_checkpoint()")

    def _release_at_exit(self) -> None:
        super()._release_at_exit()
        self.tensor.world = dataclasses.replace(self.tensor.world, group=None)
