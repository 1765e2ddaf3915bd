"""A checkpoint that DeepSpeed wrote, behind the interface zeroshard's loader reads (checkpoint/load.py).

[Note: a DeepSpeed checkpoint read whole]
DeepSpeed's files are pickles of whole partitions: there is no reading a slice of one.  Every rank
therefore reads every optimizer file once, turns the partitions back into whole parameters and moments
(partitions.py), and then answers the loader's slice reads from memory, so the loader reshards to any
world size and stage exactly as it does zeroshard's own checkpoints.  This costs each rank the whole
optimizer state in host memory for the length of the load; ``zeroshard convert`` turns the checkpoint
into zeroshard's format once, whose loads read only each rank's share.

What is read: ZeRO stages 0-3 of one data-parallel group (no tensor parallelism), fp32 and bf16
(``bf16_`` optimizer files), with Adam-family moments, universal checkpoint folders (universal_read.py)
and a pipeline engine's checkpoint at ZeRO 1-2 (pipeline_read.py); the counters, the LR scheduler's
state and the client state as DeepSpeed's ``load_checkpoint`` returns it; the model's buffers and
frozen parameters; MoE expert files at ZeRO 1-2 (moe_read.py).  Everything else (tensor-parallel
files, experts in a pipeline) is refused by name.

[Note: frozen parameters in a DeepSpeed checkpoint]
At stages 0-2 DeepSpeed's model file holds the whole module: its buffers, its frozen parameters and
(replaced here by the fp32 masters) its trained ones.  At stage 3 it holds the buffers, and each rank's
model file its piece of every frozen parameter (``frozen_param_fragments``, padded like a trained one),
which are joined in rank order and cut to ``frozen_param_shapes``, as ``zero_to_fp32.py`` does.  A
frozen weight tied under two names (a frozen embedding that is also the output layer, as in LoRA
fine-tuning of a tied model) is stored under the first and named again in ``shared_params``, like a
trained one; it is given under every name.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

import torch

from ..format import LATEST, MANIFEST, CheckpointError
from .partitions import MOMENTS, WholeState, merge_stage0, merge_stage3, merge_stage12
from .moe_read import expert_states, has_experts, merge_moe
from .pipeline_read import layer_states, pipeline_degree, read_pipeline
from .universal_read import LATEST_UNIVERSAL, is_universal, read_universal
from .unpickle import load_deepspeed_file

#: the model file of stages 0-2 (one, written by data-parallel rank 0)
MODEL_FILE = "mp_rank_00_model_states.pt"
#: the entries of a model file that DeepSpeed's ``load_checkpoint`` keeps out of the client state it
#: returns (the scheduler and optimizer too, when it loads them)
_DEEPSPEED_ENTRIES = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
                      "random_ltd", "lr_scheduler", "optimizer")


def stage3_model_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def optimizer_file(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def deepspeed_directory(root: Path, tag: Optional[str]) -> Optional[Path]:
    """The directory of the DeepSpeed checkpoint ``root/tag`` (``tag`` None: the one ``root/latest``
    names), or None where that is not one DeepSpeed wrote (a zeroshard checkpoint has a manifest)."""
    if tag is None:
        latest = root / LATEST if (root / LATEST).is_file() else root / LATEST_UNIVERSAL
        if not latest.is_file():
            return None
        tag = latest.read_text().strip()
    directory = root / tag
    if (directory / MANIFEST).is_file():
        return None
    if (directory / MODEL_FILE).is_file() or (directory / stage3_model_file(0)).is_file():
        return directory
    return None


class DeepSpeedReader:
    """The ``CheckpointReader`` interface over a DeepSpeed checkpoint directory (see [Note: a DeepSpeed
    checkpoint read whole])."""

    def _ranks_on_disk(self, bf16: bool) -> int:
        """The data-parallel degree from the optimizer files present, for a model file that does not
        record it (DeepSpeed's converter takes it from the file names too)."""
        ranks = 0
        while (self.directory / optimizer_file(ranks, bf16)).is_file():
            ranks += 1
        return max(ranks, 1)

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        model_path = self.directory / MODEL_FILE
        if not model_path.is_file():
            model_path = self.directory / stage3_model_file(0)
        self._model_path = model_path
        self.model: dict[str, Any] = load_deepspeed_file(model_path)
        self._refuse_unread(model_path)
        bf16 = (self.directory / optimizer_file(0, True)).is_file()
        world = int(self.model.get("dp_world_size") or self._ranks_on_disk(bf16))
        where = str(self.directory)
        self.whole: WholeState
        #: a pipeline's layer files, by global name (see [Note: DeepSpeed's pipeline checkpoint] in
        #: checkpoint/deepspeed_format/pipeline_read.py); empty without a pipeline
        self.layers: dict[str, torch.Tensor] = {}
        #: the experts of MoE layers, by global name (see [Note: DeepSpeed's MoE checkpoint] in
        #: checkpoint/deepspeed_format/moe_read.py); empty without experts
        self.experts: dict[str, torch.Tensor] = {}
        self._buffer_names = list(self.model.get("buffer_names") or [])
        if pipeline_degree(self.model) > 1:
            self.whole, rank0, bf16, self._buffer_names = read_pipeline(self.directory, pipeline_degree(self.model))
            self.stage = int(rank0["zero_stage"])
            self.layers = layer_states(self.directory)
        elif is_universal(self.directory):  # one folder per parameter (ds_to_universal)
            groups = [dict(g) for g in self.model["param_shapes"]]
            self.whole, rank0 = read_universal(self.directory, groups)
            self.stage = int(rank0["zero_stage"])
            bf16 = bool(((self.model.get("ds_config") or {}).get("bf16") or {}).get("enabled"))
        elif self.model.get("optimizer") is not None:  # no ZeRO: the optimizer is in the model file
            self.stage = 0
            bf16 = "fp32_groups" in self.model["optimizer"]
            optimizer = self.model["optimizer"]
            rank0 = optimizer.get("optimizer_state_dict", optimizer)
            self.whole = merge_stage0(self.model["module"], self.model.get("buffer_names") or [], optimizer,
                                      f"{model_path}")
        elif bf16 or (self.directory / optimizer_file(0, False)).is_file():
            ranks = [load_deepspeed_file(self.directory / optimizer_file(r, bf16))["optimizer_state_dict"]
                     for r in range(world)]
            self.stage = int(ranks[0]["zero_stage"])
            groups = [dict(g) for g in self.model["param_shapes"]]
            if has_experts(self.directory) and self.stage in (1, 2):
                self.whole = merge_moe(self.model, ranks, where)
                self.experts = expert_states(self.directory)
            else:
                self.whole = merge_stage3({k: v for g in groups for k, v in g.items()}, ranks, where) \
                    if self.stage == 3 else merge_stage12(groups, ranks, where)
            rank0 = ranks[0]
        else:
            raise CheckpointError(f"{self.directory}: a DeepSpeed checkpoint with neither ZeRO optimizer files "
                                  f"(*zero_pp_rank_0_mp_rank_00_optim_states.pt) nor an optimizer in its model file "
                                  f"(saved without an optimizer, or with load_optimizer_states only): not read")
        if has_experts(self.directory) and not self.experts:
            raise CheckpointError(f"{self.directory}: DeepSpeed MoE expert files are read at ZeRO 1-2 only (this "
                                  f"checkpoint: ZeRO {self.stage}{', universal' if is_universal(self.directory) else ''})")
        self.world_size = world
        self.bf16 = bf16
        self._param_groups = self._hyperparameters(rank0)
        self._steps_from_groups(rank0)
        self.manifest = _Verified()

    def identity(self) -> str:
        """What every loading rank must agree on: the digest of the model file and every file's size."""
        digest = hashlib.sha256(self._model_path.read_bytes())
        for path in sorted(self.directory.iterdir()):
            digest.update(f"{path.name}:{path.stat().st_size};".encode())
        return digest.hexdigest()

    def _refuse_unread(self, path: Path) -> None:
        dims = self.model.get("checkpoint_parallel_dimensions") or {}
        stages = pipeline_degree(self.model)
        tensor_parallel = int(self.model.get("mp_world_size", 1)) != stages or int(dims.get("tp_degree", 1)) != 1
        if tensor_parallel and not is_universal(self.directory):  # a universal folder holds them joined
            raise CheckpointError(f"{path}: a DeepSpeed checkpoint of a tensor-parallel job "
                                  f"(mp_world_size {self.model.get('mp_world_size')}, {dims}): not read yet")
        if stages == 1 and any(self.directory.glob("layer_*-model_states.pt")):
            raise CheckpointError(f"{self.directory}: DeepSpeed pipeline layer files beside a model file that "
                                  f"records no pipeline (checkpoint_parallel_dimensions): not read")
        if stages > 1 and has_experts(self.directory):
            raise CheckpointError(f"{self.directory}: DeepSpeed MoE expert files of a pipeline are not read yet")

    @staticmethod
    def _groups(rank0: dict[str, Any]) -> list[dict[str, Any]]:
        base = rank0.get("base_optimizer_state") or rank0.get("optimizer_state_dict") or rank0
        return list(base.get("param_groups", []))

    def _hyperparameters(self, rank0: dict[str, Any]) -> list[dict[str, Any]]:
        return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k not in ("params", "step")}
                for g in self._groups(rank0)]

    def _steps_from_groups(self, rank0: dict[str, Any]) -> None:
        """Adam's step where an optimizer kept it per group rather than per state (DeepSpeed's FusedAdam
        of older checkpoints)."""
        for scalars, group in zip(self.whole.scalars, self._groups(rank0)):
            if "step" not in scalars and "step" in group:
                scalars["step"] = torch.tensor(float(group["step"]))

    # ------------------------------------------------------------------ the reader interface
    @property
    def data(self) -> dict[str, Any]:
        """The checkpoint's scalars in the form of zeroshard's manifest (what the loader reads of it)."""
        steps = int(self.model.get("global_steps", 0))
        gas = int((self.model.get("ds_config") or {}).get("gradient_accumulation_steps", 1) or 1)
        return {
            "world_size": self.world_size, "stage": self.stage,
            "dtype": "bfloat16" if self.bf16 else "float32",
            "engine": {"global_steps": steps, "micro_steps": steps * gas,
                       "global_samples": int(self.model.get("global_samples", 0)),
                       "skipped_steps": int(self.model.get("skipped_steps", 0))},
            "optimizer": {"param_groups": self._param_groups},
            "lr_scheduler": self.model.get("lr_scheduler"),
            "client_state": self.client_state(),
        }

    def model_description(self) -> dict[str, Any]:
        """The model as zeroshard's manifest describes one: its state-dict keys, which trained parameter
        each key is (tied weights under every name), and its buffers."""
        module = self.model.get("module") or {}
        trainable_of = {k: k for k in self.param_names()}
        shared = self.model.get("shared_params") or {}
        trainable_of.update({k: v for k, v in shared.items() if v in trainable_of})
        keys = (list(module) + list(self.experts)) or list(self.layers) or list(trainable_of)
        return {"state_dict_keys": keys, "trainable_of": trainable_of,
                # frozen weights tied under other names (see [Note: tied weights in DeepSpeed's layout] in
                # checkpoint/deepspeed_format/writer.py)
                "frozen_tied_to": {k: v for k, v in shared.items() if v not in trainable_of},
                "buffer_names": list(self._buffer_names), "hf_config": None,
                "class": "DeepSpeed checkpoint", "peft_config": None}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict in fp32, in its order: the trained parameters' masters, the buffers and
        frozen parameters (what DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` returns)."""
        description, extra = self.model_description(), self.extra()
        out = {}
        for key in description["state_dict_keys"]:
            name = description["trainable_of"].get(key)
            value = self.tensor(name) if name is not None else extra.get(key)
            if value is not None:
                out[key] = value.float() if value.is_floating_point() else value
        return out

    def client_state(self) -> dict[str, Any]:
        """What DeepSpeed's ``load_checkpoint`` returns as the client state: the model file's entries but
        its own."""
        return {k: v for k, v in self.model.items() if k not in _DEEPSPEED_ENTRIES}

    def param_names(self) -> list[str]:
        return list(self.whole.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in self.whole.shapes[name])

    def bucket_of(self, name: str) -> int:
        return self.whole.group_of[name]

    def read(self, name: str, key: str = "param", start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Elements ``[start, end)`` of ``name``'s fp32 master (``param``) or moment (``optim.<name>``)."""
        if name not in self.whole.tensors:
            raise CheckpointError(f"{self.directory}: has no parameter {name!r}")
        which = key[len("optim."):] if key.startswith("optim.") else key
        return self.whole.tensors[name][which][start:end]

    def tensor(self, name: str, key: str = "param") -> torch.Tensor:
        return self.read(name, key).view(self.shape(name))

    def scalar_state(self, bucket: int) -> dict[str, torch.Tensor]:
        return dict(self.whole.scalars[bucket])

    def optimizer_state_keys(self) -> list[str]:
        return list(MOMENTS)

    def holds(self, name: str, key: str) -> bool:
        """Whether ``key`` (``optim.<state>``) was saved for ``name``: DeepSpeed saves every moment of all."""
        return name in self.whole.tensors and key[len("optim."):] in self.whole.tensors[name]

    def client_tensor(self, name: str) -> torch.Tensor:
        """DeepSpeed's client state holds its values as they were (``client_state()``): none is stored apart."""
        raise CheckpointError(f"{self.directory}: a DeepSpeed checkpoint stores no client-state tensor apart "
                              f"({name!r} asked for)")

    def rank_tensor(self, rank: int, name: str) -> Optional[torch.Tensor]:
        return None  # DeepSpeed saves no random generator states

    def extra(self) -> dict[str, torch.Tensor]:
        """The model's buffers and frozen parameters, by state-dict name (see [Note: frozen parameters
        in a DeepSpeed checkpoint]); a frozen weight tied under other names under each of them."""
        out = self._stored_extra()
        for alias, holder in (self.model.get("shared_params") or {}).items():
            if holder in out and alias not in out:
                out[alias] = out[holder]
        return out

    def _stored_extra(self) -> dict[str, torch.Tensor]:
        module = self.model.get("module") or {}
        shared = set(self.model.get("shared_params") or {})
        if self.layers:
            return {k: v for k, v in self.layers.items() if k not in self.whole.shapes}
        if self.stage < 3:
            every = {**module, **self.experts}
            return {k: v for k, v in every.items() if k not in self.whole.shapes and k not in shared}
        out = {name: module[name] for name in self.model.get("buffer_names") or [] if name in module}
        shapes = self.model.get("frozen_param_shapes") or {}
        if shapes:
            ranks = [self.model] + [load_deepspeed_file(self.directory / stage3_model_file(r))
                                    for r in range(1, self.world_size)]
            for name, shape in shapes.items():
                pieces = [(m.get("frozen_param_fragments") or {}).get(name) for m in ranks]
                flat = [p.reshape(-1) for p in pieces if isinstance(p, torch.Tensor)]
                if len(flat) != len(ranks):
                    raise CheckpointError(f"{self.directory}: frozen parameter {name!r} lacks a rank's fragment")
                out[name] = torch.cat(flat)[:torch.Size(shape).numel()].view(shape).clone()
        return out

    def home_file(self) -> str:
        return MODEL_FILE

    def scalar_file(self, bucket: int) -> str:
        return MODEL_FILE

    def extra_files(self) -> list[str]:
        return []

    def files_holding(self, name: str, start: int = 0, end: Optional[int] = None) -> set[str]:
        return set()

    def close(self) -> None:
        self.whole.tensors.clear()

    def __enter__(self) -> "DeepSpeedReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Verified:
    """DeepSpeed records no checksums: the files were read whole and checked as they were unpickled."""

    def verify_files(self, files: Any = None) -> None:
        return None
