"""A DeepSpeed ZeRO checkpoint's flat partitions turned back into whole parameters and Adam moments.

[Note: how DeepSpeed lays out its partitions]
Stages 1 and 2 flatten each parameter group (in ``param_shapes`` order) into one vector padded to a
multiple of ``2 x world`` and cut it into ``world`` equal partitions; rank ``r``'s file holds its
partition of the fp32 masters (``single_partition_of_fp32_groups``, without the padding on the last
rank, whose size that rank's ``group_paddings`` gives) and of each Adam moment (with the padding).  The whole
vector is the ranks' partitions, unpadded, end to end, and each parameter its next ``numel`` elements.
Stage 3 partitions every parameter on its own: each is padded to a multiple of ``world`` and rank ``r``
holds its ``r``-th equal piece; a rank's flat vector (``fp32_flat_groups``, and the moments of the
same sub-group) is its pieces of every parameter in order, so a parameter is the ranks' pieces at the
same offset, joined and cut to ``numel``.  These are the rules of DeepSpeed's own ``zero_to_fp32.py``.

[Note: ZeRO stage 0 in DeepSpeed's model file]
Without ZeRO, DeepSpeed saves the optimizer inside the model file, by position, not by name: torch's
optimizer state (``state[i]`` for the ``i``-th parameter handed to the optimizer, which is the model's
``i``-th parameter as ``model.parameters()`` lists them, frozen ones included) in fp32; under bf16 its
mixed-precision optimizer's ``fp32_groups`` (the masters of the trained parameters only, in the model's
order) beside torch's state of those masters.  A parameter is named by its position among the module's
parameters (fp32), or as the next trained one whose saved weight its master rounds to (bf16); every
moment's shape is checked against the parameter it is given to, and a mismatch (an optimizer built on
another list of parameters) is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..format import CheckpointError

#: the Adam moments a DeepSpeed checkpoint keeps per element, by DeepSpeed's (torch's) names
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class WholeState:
    """Every trained parameter's fp32 master and moments, whole, by name, in DeepSpeed's order."""

    shapes: dict[str, torch.Size]
    #: name -> {"param": fp32 master, "exp_avg": ..., "exp_avg_sq": ...}, each 1D
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: name -> the DeepSpeed parameter group (stages 1-2) or sub-group (stage 3) it was stepped in
    group_of: dict[str, int] = field(default_factory=dict)
    #: per group: the optimizer's per-group scalar state (Adam's ``step``)
    scalars: list[dict[str, torch.Tensor]] = field(default_factory=list)


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out


def _moments(state: Any, group: int, where: str) -> dict[str, torch.Tensor]:
    # a dict by group index, as torch saves it; DeepSpeed's converter indexes a list of groups alike
    entry = state.get(group) if isinstance(state, dict) else (state[group] if group < len(state) else None)
    if entry is None:
        raise CheckpointError(f"{where}: no optimizer state for group {group} (a checkpoint saved before the first "
                              f"step, or of an optimizer without Adam's moments, is not read)")
    missing = [m for m in MOMENTS if not isinstance(entry.get(m), torch.Tensor)]
    if missing:
        raise CheckpointError(f"{where}: group {group} has no {', '.join(missing)} (only Adam-family optimizer "
                              f"state is read)")
    return entry


def _scalars(entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v).clone() for k, v in entry.items() if k not in MOMENTS and k != "params"}


def merge_stage12(groups: list[dict[str, torch.Size]], ranks: list[dict[str, Any]], where: str) -> WholeState:
    """Stages 1-2: ``ranks``: each rank's ``optimizer_state_dict`` (see [Note: how DeepSpeed lays out its
    partitions])."""
    whole = WholeState({k: v for g in groups for k, v in g.items()})
    for g, shapes in enumerate(groups):
        keys = ("param",) + MOMENTS
        pieces: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        for r, sd in enumerate(ranks):
            here = f"{where} (rank {r})"
            fp32 = sd["single_partition_of_fp32_groups"][g]
            moments = _moments(sd["base_optimizer_state"]["state"], g, here)
            padding = int(sd.get("group_paddings", [0] * len(groups))[g])  # each rank's own (the last's only)
            if any(p for p in (sd.get("param_alignment_paddings") or [[]])[g]):
                raise CheckpointError(f"{here}: per-parameter alignment padding is not read yet")
            size = moments["exp_avg"].numel() - padding
            for key, tensor in (("param", fp32), *((m, moments[m]) for m in MOMENTS)):
                if tensor.numel() < size:
                    raise CheckpointError(f"{here}: group {g}'s {key} holds {tensor.numel()} elements, "
                                          f"fewer than its partition's {size}")
                pieces[key].append(tensor.reshape(-1)[:size].float())
            if r == 0:
                whole.scalars.append(_scalars(moments))
        flat = {k: torch.cat(v) for k, v in pieces.items()}
        offset = 0
        for name, shape in shapes.items():
            n = _numel(shape)
            if offset + n > flat["param"].numel():
                raise CheckpointError(f"{where}: group {g}'s partitions hold {flat['param'].numel()} elements, "
                                      f"too few for its parameters (param_shapes)")
            whole.tensors[name] = {k: v[offset:offset + n].clone() for k, v in flat.items()}
            whole.group_of[name] = g
            offset += n
    return whole


def merge_stage3(shapes: dict[str, torch.Size], ranks: list[dict[str, Any]], where: str) -> WholeState:
    """Stage 3: ``ranks``: each rank's ``optimizer_state_dict`` (see [Note: how DeepSpeed lays out its
    partitions])."""
    world = len(ranks)
    whole = WholeState(dict(shapes))
    flats: list[dict[str, torch.Tensor]] = []
    bounds: list[int] = []  # where each sub-group ends in a rank's flat vector
    for r, sd in enumerate(ranks):
        here = f"{where} (rank {r})"
        groups = sd["fp32_flat_groups"]
        state = sd["optimizer_state_dict"]["state"]
        entries = [_moments(state, g, here) for g in range(len(groups))]
        flats.append({"param": torch.cat([t.reshape(-1).float() for t in groups]),
                      **{m: torch.cat([e[m].reshape(-1).float() for e in entries]) for m in MOMENTS}})
        if r == 0:
            whole.scalars = [_scalars(e) for e in entries]
            bounds = [int(t.numel()) for t in groups]
    ends = torch.tensor(bounds).cumsum(0).tolist()
    offset = 0
    for name, shape in shapes.items():
        n = _numel(shape)
        piece = -(-n // world)
        if any(offset + piece > f["param"].numel() for f in flats):
            raise CheckpointError(f"{where}: the ranks' partitions are too small for the parameters (param_shapes)")
        whole.tensors[name] = {k: torch.cat([f[k][offset:offset + piece] for f in flats])[:n].clone()
                               for k in flats[0]}
        whole.group_of[name] = next(g for g, end in enumerate(ends) if offset < end)
        offset += piece
    return whole


def _named_state(state: dict[Any, Any], index: int, name: str, shape: torch.Size, where: str) -> dict[str, torch.Tensor]:
    entry = _moments(state, index, where)
    if tuple(entry["exp_avg"].shape) != tuple(shape):
        raise CheckpointError(f"{where}: optimizer state {index} has shape {tuple(entry['exp_avg'].shape)}, but the "
                              f"parameter in its place, {name}, has {tuple(shape)} (an optimizer built on another list "
                              f"of parameters is not read)")
    return entry


def merge_stage0(module: dict[str, torch.Tensor], buffers: Sequence[str], optimizer: dict[str, Any],
                 where: str) -> WholeState:
    """ZeRO stage 0 (see [Note: ZeRO stage 0 in DeepSpeed's model file])."""
    names = [k for k in module if k not in set(buffers)]
    whole = WholeState({})
    masters = optimizer.get("fp32_groups")
    torch_state = optimizer["optimizer_state_dict"] if masters is not None else optimizer
    state, groups = torch_state["state"], torch_state["param_groups"]
    candidates = iter(names)
    for g, group in enumerate(groups):
        for position, index in enumerate(group["params"]):
            if masters is None:
                if index >= len(names) or index not in state:
                    continue  # no state: a frozen parameter (or one never stepped), kept with the module
                name, master = names[index], module[names[index]].float()
            else:
                master = masters[g][position].float()
                name = next((n for n in candidates if module[n].shape == master.shape
                             and torch.equal(master.to(module[n].dtype), module[n])), "")
                if not name:
                    raise CheckpointError(f"{where}: fp32 master {position} of group {g} matches no parameter of "
                                          f"the saved module")
            entry = _named_state(state, index, name, master.shape, where)
            whole.shapes[name] = master.shape
            whole.tensors[name] = {"param": master.reshape(-1).clone(),
                                   **{m: entry[m].reshape(-1).float().clone() for m in MOMENTS}}
            whole.group_of[name] = g
            if len(whole.scalars) == g:
                whole.scalars.append(_scalars(entry))
    order = {n: i for i, n in enumerate(names)}
    whole.shapes = dict(sorted(whole.shapes.items(), key=lambda item: order[item[0]]))
    return whole
