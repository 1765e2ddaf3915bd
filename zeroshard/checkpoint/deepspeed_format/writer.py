"""A checkpoint written in DeepSpeed's layout, for DeepSpeed's ``load_checkpoint`` and ``zero_to_fp32.py``.

[Note: what a DeepSpeed checkpoint is written from]
The writer takes any checkpoint reader (zeroshard's own, or a DeepSpeed checkpoint read whole) and a
target: DeepSpeed's data-parallel world size, ZeRO stage (1-3) and precision (fp32 or bf16).  DeepSpeed
loads a ZeRO checkpoint only at the world size and stage it names, and copies each rank's flat
partitions into its own optimizer as they are, without names: the partitions must be cut exactly as
the loading engine cuts its own (the rules of [Note: how DeepSpeed lays out its partitions] in
checkpoint/deepspeed_format/partitions.py, inverted), from its parameter groups in its order.  That order is the one DeepSpeed
builds from ``model.parameters()`` handed to it: each optimizer group's parameters in the model's
state-dict order, which is the order the model's names are recorded in (a DeepSpeed group whose
parameters come in another order than the model's, or a stage-3 group that ``sub_group_size`` cuts
into several sub-groups, is not what these files describe).  Each group's Adam ``step`` is its
parameters' step; the hyperparameters are the saved ones, but for ``fused`` and ``foreach``, which
name an implementation and are left for the loading optimizer to choose.  ``clip_grad`` is written
only where known (an engine's save, a DeepSpeed checkpoint's config): DeepSpeed's stages 1-2 take it
from the file over their config.

[Note: tied weights in DeepSpeed's layout]
A weight a model holds under two names (an output layer tied to its embedding) is one parameter to
the optimizer, so DeepSpeed's partitions, ``param_shapes`` and Adam state hold it once, under the name
``named_parameters()`` lists first; the model file's ``shared_params`` maps every further name to that
one (``zero_to_fp32.py`` copies the weight under those names), and its ``module`` lists every name,
one tensor behind them.  zeroshard's manifest records the same mapping (``trainable_of``: each
state-dict key's trained parameter, named as ``named_parameters()`` names it), so the groups are cut
from the distinct trained parameters and ``shared_params`` is the other keys (at stage 3 in rank 0's
model file only: DeepSpeed's other ranks record none, and ``zero_to_fp32.py`` reads rank 0's).  A
frozen weight tied under two names (a frozen embedding that is the output layer, as in LoRA fine-tuning)
is one frozen parameter to DeepSpeed in the same way: one entry of ``frozen_param_shapes`` and of the
fragments, the second name in ``shared_params``.  Where the description records such ties
(``frozen_tied_to``: a DeepSpeed checkpoint's, and a ``zeroshard convert`` of one) they are written so;
zeroshard's own manifest does not record them, and such a weight is written under each of its names
(DeepSpeed loads it and ``zero_to_fp32.py`` consolidates it to the same weights).
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..format import LATEST, CheckpointError, write_text_atomic
from .layout_metadata import checkpoint_parallel_metadata
from .partitions import MOMENTS
from .pickler import save_deepspeed_file, stand_in
from .reader import MODEL_FILE, optimizer_file, stage3_model_file
from .unpickle import ZeroStageEnum

#: the DeepSpeed release whose layout is written (its loader checks that a version is there)
DEEPSPEED_LAYOUT_VERSION = "0.19.8"
#: DeepSpeed's stages 1-2 pad a group to a multiple of this times the world size (4-byte alignment of
#: 16-bit elements)
_ALIGNMENT = 2
_IMPLEMENTATION_KEYS = ("fused", "foreach")


def describe_model(reader: Any) -> dict[str, Any]:
    """The model as the manifest describes it (a DeepSpeed checkpoint's described from its model file)."""
    describe = getattr(reader, "model_description", None)
    return describe() if describe is not None else dict(reader.data.get("model") or {})


def _groups(reader: Any, model: dict[str, Any]) -> dict[int, list[str]]:
    """The trained parameters by optimizer group (by the group's index among the optimizer's), each group
    in the model's order (see [Note: what a DeepSpeed checkpoint is written from])."""
    buckets = reader.data.get("buckets")
    order = {name: i for i, name in enumerate(dict.fromkeys(
        (model.get("trainable_of") or {}).get(k, k) for k in model.get("state_dict_keys") or []))}
    names = sorted(reader.param_names(), key=lambda n: order.get(n, len(order)))
    groups: dict[int, list[str]] = {}
    for name in names:
        bucket = reader.bucket_of(name)
        group = int(buckets[bucket].get("group", 0)) if buckets else int(bucket)
        groups.setdefault(group, []).append(name)
    return {g: groups[g] for g in sorted(groups)}


def _param_group(reader: Any, group: int, params: list[int]) -> dict[str, Any]:
    saved = (reader.data.get("optimizer") or {}).get("param_groups") or []
    hyper = dict(saved[group]) if group < len(saved) else {}
    hyper = {k: tuple(v) if k == "betas" else v for k, v in hyper.items()}
    hyper.update({k: None for k in _IMPLEMENTATION_KEYS if k in hyper})
    return {**hyper, "params": params}


def _flat(reader: Any, names: Sequence[str], key: str) -> torch.Tensor:
    return torch.cat([reader.read(n, key).reshape(-1).float() for n in names])


def _pieces(reader: Any, names: Sequence[str], key: str, world: int) -> list[torch.Tensor]:
    """Stage 3: each rank's pieces of every parameter, each padded to a multiple of ``world``."""
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for name in names:
        whole = reader.read(name, key).reshape(-1).float()
        piece = -(-whole.numel() // world)
        padded = torch.cat([whole, whole.new_zeros(piece * world - whole.numel())])
        for r in range(world):
            per_rank[r].append(padded[r * piece:(r + 1) * piece])
    return [torch.cat(p) for p in per_rank]


class _Target:
    """What one write produces: the layout's numbers and the model file's shared entries."""

    def __init__(self, reader: Any, world: int, stage: int, dtype: torch.dtype, clip_grad: Optional[float],
                 ds_config: Optional[dict[str, Any]]) -> None:
        if stage not in (1, 2, 3):
            raise CheckpointError(f"DeepSpeed's layout is written at ZeRO stages 1-3, not {stage}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise CheckpointError(f"DeepSpeed's layout is written for fp32 or bf16 training, not {dtype}")
        missing = [n for n in reader.param_names() for m in MOMENTS if not reader.holds(n, f"optim.{m}")]
        if missing:
            raise CheckpointError(f"a checkpoint without Adam's moments for {', '.join(sorted(set(missing))[:5])}: "
                                  f"DeepSpeed's layout is written for Adam-family optimizer state")
        self.reader, self.world, self.stage, self.dtype = reader, world, stage, dtype
        self.model = describe_model(reader)
        self.extra = reader.extra()  # buffers and frozen parameters, read once for every rank's model file
        by_group = _groups(reader, self.model)
        self.clip_grad, self.groups, self.group_ids = clip_grad, list(by_group.values()), list(by_group)
        self.bf16 = dtype == torch.bfloat16
        self.ds_config = ds_config if ds_config is not None else {
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": self.bf16},
            "gradient_accumulation_steps": 1}

    def step(self, group: list[str]) -> torch.Tensor:
        steps = self.reader.scalar_state(self.reader.bucket_of(group[0]))
        return torch.as_tensor(steps.get("step", 0.0), dtype=torch.float32).clone()

    def model_state(self, rank: int) -> dict[str, Any]:
        reader, data, model = self.reader, self.reader.data, self.model
        trainable_of = model.get("trainable_of") or {n: n for n in reader.param_names()}
        extra = self.extra
        buffer_names = [n for n in model.get("buffer_names", list(extra)) if n in extra]
        tied_to = {k: v for k, v in (model.get("frozen_tied_to") or {}).items() if k in extra and v in extra}
        frozen = [n for n in extra if n not in buffer_names and n not in tied_to]
        module: dict[str, torch.Tensor] = OrderedDict()
        keys = model.get("state_dict_keys") or [*extra, *reader.param_names()]
        fragments: dict[str, torch.Tensor] = OrderedDict()
        one: dict[str, torch.Tensor] = {}  # one tensor per parameter, under each of its names
        for key in keys:
            if key in buffer_names:
                module[key] = extra[key]
            elif key in trainable_of or key in frozen or key in tied_to:
                name = trainable_of.get(key) or tied_to.get(key, key)
                if name not in one:
                    value = reader.tensor(name) if key in trainable_of else extra[name]
                    one[name] = value.new_empty(0, dtype=self.dtype) if self.stage == 3 else value.to(self.dtype)
                module[key] = one[name]
        for name in frozen:
            value = extra[name].to(self.dtype)
            if self.stage == 3:
                value = _pieces_of(value, self.world)[rank]
            fragments[name] = value
        engine = data.get("engine") or {}
        client = dict(data.get("client_state") or {})
        return {  # the client state first: a DeepSpeed checkpoint's holds the entries of its model file
            **client, "module": module, "buffer_names": buffer_names, "optimizer": None,
            "param_shapes": [OrderedDict((n, torch.Size(reader.shape(n))) for n in g) for g in self.groups],
            # DeepSpeed records frozen parameters apart where it partitions gradients (stages 2-3)
            "frozen_param_shapes": OrderedDict((n, extra[n].shape) for n in frozen) if self.stage > 1 else None,
            # see [Note: tied weights in DeepSpeed's layout]
            "shared_params": {k: trainable_of.get(k) or tied_to[k] for k in keys
                              if trainable_of.get(k, k) != k or k in tied_to} if rank == 0 else {},
            "frozen_param_fragments": fragments if self.stage > 1 else None,
            "lr_scheduler": data.get("lr_scheduler"), "data_sampler": None, "random_ltd": None,
            "skipped_steps": int(engine.get("skipped_steps", 0)), "global_steps": int(engine.get("global_steps", 0)),
            "global_samples": int(engine.get("global_samples", 0)), "dp_world_size": self.world, "mp_world_size": 1,
            **checkpoint_parallel_metadata(None),
            "ds_config": self.ds_config, "ds_version": DEEPSPEED_LAYOUT_VERSION,
        }

    def loss_scaler(self) -> Any:
        return stand_in("deepspeed.runtime.fp16.loss_scaler.LossScaler", cur_scale=1.0, dynamic=False)

    def optimizer_states12(self) -> list[dict[str, Any]]:
        """Stages 1-2: each rank's ``optimizer_state_dict`` (the inverse of ``merge_stage12``)."""
        ranks: list[dict[str, Any]] = []
        flats = []
        for group in self.groups:
            numel = sum(self.reader.read(n).numel() for n in group)
            padded = -(-numel // (_ALIGNMENT * self.world)) * _ALIGNMENT * self.world
            flats.append({key: torch.cat([_flat(self.reader, group, key), torch.zeros(padded - numel)])
                          for key in ("param", *(f"optim.{m}" for m in MOMENTS))})
        for r in range(self.world):
            fp32, paddings, state, groups, mappings = [], [], {}, [], []
            for g, (group, flat) in enumerate(zip(self.groups, flats)):
                size = flat["param"].numel() // self.world
                start, numel = r * size, sum(self.reader.read(n).numel() for n in group)
                padding = max(0, start + size - numel) if r == self.world - 1 else 0
                fp32.append(flat["param"][start:start + size - padding].clone())
                paddings.append(padding)
                state[g] = {"step": self.step(group),
                            **{m: flat[f"optim.{m}"][start:start + size].clone() for m in MOMENTS}}
                groups.append(_param_group(self.reader, self.group_ids[g], [g]))
                mappings.append(_slice_mappings(self.reader, group, start, size))
            sd: dict[str, Any] = {"loss_scaler": self.loss_scaler(), "dynamic_loss_scale": False, "overflow": False}
            if self.clip_grad is not None:
                sd["clip_grad"] = float(self.clip_grad)
            sd.update({
                "base_optimizer_state": {"state": state, "param_groups": groups},
                "single_partition_of_fp32_groups": fp32,
                "zero_stage": ZeroStageEnum.gradients if self.stage == 2 else ZeroStageEnum.optimizer_states,
                "group_paddings": paddings,
                "param_alignment_paddings": [[0] * len(g) for g in self.groups],
                "partition_count": [self.world] * len(self.groups),
                "ds_version": DEEPSPEED_LAYOUT_VERSION, "param_slice_mappings": mappings,
            })
            ranks.append(sd)
        return ranks

    def optimizer_states3(self) -> list[dict[str, Any]]:
        """Stage 3: each rank's ``optimizer_state_dict`` (the inverse of ``merge_stage3``), one sub-group
        per parameter group."""
        pieces = [{key: _pieces(self.reader, group, key, self.world) for key in ("param", *(f"optim.{m}" for m in MOMENTS))}
                  for group in self.groups]
        ranks = []
        for r in range(self.world):
            state = {g: {"step": self.step(group), **{m: p[f"optim.{m}"][r].clone() for m in MOMENTS}}
                     for g, (group, p) in enumerate(zip(self.groups, pieces))}
            ranks.append({
                "zero_stage": ZeroStageEnum.weights, "loss_scaler": self.loss_scaler(), "dynamic_loss_scale": False,
                "overflow": False, "partition_count": self.world,
                "optimizer_state_dict": {"state": state, "param_groups": [
                    _param_group(self.reader, group_id, [g]) for g, group_id in enumerate(self.group_ids)]},
                "fp32_flat_groups": [p["param"][r].clone() for p in pieces],
            })
        return ranks


def _pieces_of(value: torch.Tensor, world: int) -> list[torch.Tensor]:
    flat = value.reshape(-1)
    piece = -(-flat.numel() // world)
    padded = torch.cat([flat, flat.new_zeros(piece * world - flat.numel())])
    return [padded[r * piece:(r + 1) * piece].clone() for r in range(world)]


def _slice_mappings(reader: Any, group: Sequence[str], start: int, size: int) -> dict[str, Any]:
    """Which part of each parameter a rank's partition holds (DeepSpeed's ``param_slice_mappings``,
    which its universal-checkpoint conversion reads)."""
    out: dict[str, Any] = OrderedDict()
    offset = 0
    for name in group:
        numel = reader.read(name).numel()
        lo, hi = max(offset, start), min(offset + numel, start + size)
        if lo < hi:
            out[name] = stand_in("deepspeed.utils.tensor_fragment.fragment_address", numel=hi - lo, start=lo - start)
        offset += numel
    return out


def write_deepspeed(reader: Any, out: str | Path, tag: str, world_size: int, stage: int,
                    dtype: torch.dtype = torch.float32, clip_grad: Optional[float] = None,
                    ds_config: Optional[dict[str, Any]] = None, save_latest: bool = True) -> Path:
    """Write what ``reader`` holds as the DeepSpeed checkpoint ``out/tag`` of a ``world_size``-rank job at
    ZeRO ``stage`` training in ``dtype`` (see [Note: what a DeepSpeed checkpoint is written from]);
    ``latest`` names it.  Returns the tag's directory."""
    target = _Target(reader, int(world_size), int(stage), dtype, clip_grad, ds_config)
    final = Path(out) / str(tag)
    staging = Path(out) / f".{tag}.incomplete"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    ranks = target.optimizer_states3() if target.stage == 3 else target.optimizer_states12()
    for r, optimizer_state in enumerate(ranks):
        save_deepspeed_file({"optimizer_state_dict": optimizer_state, "ds_config": target.ds_config,
                             "ds_version": DEEPSPEED_LAYOUT_VERSION}, staging / optimizer_file(r, target.bf16))
        if target.stage == 3:
            save_deepspeed_file(target.model_state(r), staging / stage3_model_file(r))
    if target.stage < 3:
        save_deepspeed_file(target.model_state(0), staging / MODEL_FILE)
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    if save_latest:
        write_text_atomic(Path(out) / LATEST, str(tag))
    return final
