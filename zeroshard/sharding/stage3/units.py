"""Stage 3's gather units: which parameters are all-gathered together, and which stay whole.

[Note: gather units]
A unit is a group of parameters gathered with one collective just before it is needed and released
right after.  zeroshard picks units the way FSDP2 users wrap models: every element of a
``nn.ModuleList`` / ``nn.Sequential`` found in the model (a transformer block, typically) is a unit,
and everything else belongs to the *root* unit, gathered for the whole forward and backward of the
model.  Coarse units are what make the hard cases work without special code: a forward that reads a
submodule's weight directly (``F.linear(x, self.embed.weight)``), a module called twice, a weight
tied between the embedding and the head.  A parameter reachable from two different units (shared
between blocks) is moved to the root unit, so it is always gathered whenever either block runs.

[Note: leaf modules]
A module marked as a *leaf* (DeepSpeed's ``set_z3_leaf_modules``, before ``initialize()``) is one unit
with everything below it: gathered whole by its own forward pre-hook, its submodules given no unit of
their own.  The case it is for is a layer whose forward runs a data-dependent subset of its children
(a mixture of experts): without the mark each child is a unit, gathered only by the ranks whose data
reach it, and the ranks then agree on each such gather in rounds (see [Note: ranks agree on every
gather] in sharding/stage3/gather_agreement.py); with it, every rank runs the layer and gathers the
same one unit for it, whichever children its data reach.  A leaf must be a module whose forward runs (not a
bare ``ModuleList``).  The marks are held weakly here, by module identity, never as attributes of the
user's modules.

Parameters with at most ``stage3_param_persistence_threshold`` elements (biases, norms) are
*persistent*: kept whole on every rank, gradients reduce-scattered and the parameter refreshed by an
all-gather after the step, exactly as at stage 2.  They never pay a gather latency in forward.

[Note: frozen parameters at stage 3]
A LoRA job freezes almost the whole model, so stage 3 shards frozen parameters too (as DeepSpeed's
ZeRO-3 and FSDP2 do): they go into buckets of their own, after every trainable bucket, in the same
units, gathered, prefetched and released exactly like the trainable ones, in the training dtype.
They have no gradient, no optimizer state and no masters, and are never reduced: the strategy and the
optimizer only see the trainable buckets (``FlatLayout.trainable()``).  Frozen parameters at or below
the persistence threshold stay whole in their modules, as do all frozen parameters at stages 0-2
(which, like DDP, keep every parameter whole).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Collection, Iterator, Mapping, Sequence

from torch import nn

from ..layout import FlatLayout, LayoutBuilder, runs_by_kind, size_runs

ROOT = "<root>"
#: the optimizer-group index of frozen parameters' buckets (they belong to no optimizer group)
FROZEN_GROUP = -1

# Parameters a module's forward uses although another module owns them (DeepSpeed's
# ``register_external_parameter``): module -> those parameters.
_EXTERNAL: "weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]]" = weakref.WeakKeyDictionary()


# Modules marked as leaves (see [Note: leaf modules]).
_LEAVES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def mark_leaf(module: nn.Module, leaf: bool = True) -> None:
    """Mark ``module`` as a leaf unit (``leaf=False``: remove the mark); see [Note: leaf modules]."""
    if leaf:
        _LEAVES.add(module)
    else:
        _LEAVES.discard(module)


def is_leaf(module: nn.Module) -> bool:
    """Whether ``module`` is marked as a leaf unit."""
    return module in _LEAVES


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter``, which another module owns.

    Stage 3 then gathers the parameter whenever ``module`` runs: it joins the root unit if it is not
    already in the unit that holds ``module`` (see [Note: gather units]).
    """
    _EXTERNAL.setdefault(module, []).append(parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`."""
    held = _EXTERNAL.get(module, [])
    _EXTERNAL[module] = [p for p in held if p is not parameter]


def rebind_external_parameters(replaced: Mapping[int, nn.Parameter]) -> None:
    """``zeroshard.Init``'s parameters are swapped for the engine's at initialize(): follow the swap."""
    for module, held in _EXTERNAL.items():
        _EXTERNAL[module] = [replaced.get(id(p), p) for p in held]


def _external_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    for m in module.modules():
        yield from _EXTERNAL.get(m, [])


@dataclass(frozen=True)
class Unit:
    """A gather unit: its name, the module whose forward brackets its use, and its bucket."""

    name: str
    module: nn.Module
    bucket_index: int


@dataclass(frozen=True)
class Stage3Plan:
    layout: FlatLayout  # trainable buckets first, then the frozen ones
    units: tuple[Unit, ...]  # sharded buckets, one per unit that has any
    persistent_buckets: frozenset[int]
    #: the parameters in the storage: the trainable ones, then the frozen ones that are sharded
    params: tuple[nn.Parameter, ...] = ()
    names: tuple[str, ...] = ()


def _block_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The elements of the outermost ModuleLists / Sequentials and the outermost leaf modules (see
    [Note: leaf modules]), in registration order."""
    blocks: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if is_leaf(child):
                blocks.append((path, child))
            elif isinstance(child, (nn.ModuleList, nn.Sequential)) and child is not model:
                blocks.extend((f"{path}.{n}", m) for n, m in child.named_children())
            else:
                visit(path, child)

    if is_leaf(model):  # the whole model is one unit: the root
        return []
    if isinstance(model, (nn.ModuleList, nn.Sequential)):
        return [(name, child) for name, child in model.named_children()]
    visit("", model)
    return blocks


def plan_units(model: nn.Module, params: Sequence[nn.Parameter], names: Sequence[str],
               group_of: Sequence[int], persistence_threshold: int, bucket_numel: int,
               world_size: int, frozen: Sequence[tuple[str, nn.Parameter]] = (),
               experts: Collection[int] = (), experts_world_size: int = 0,
               interleaved_groups: bool = False) -> Stage3Plan:
    """Assign each trainable parameter to a unit (or to a persistent bucket) and lay out buckets; then
    the ``frozen`` (name, parameter) pairs above the threshold, in buckets of their own (see
    [Note: frozen parameters at stage 3]).  ``experts`` (indices of trainable parameters): experts'
    parameters, in buckets of their own sharded over ``experts_world_size`` ranks (see [Note: experts
    sharded over the ranks that hold them] in experts/groups.py).  A unit has a bucket per group;
    ``interleaved_groups``: the persistent parameters' buckets gather each group's from several layers
    (see [Note: buckets of groups that alternate] in sharding/layout.py)."""
    sharded_frozen = [(n, p) for n, p in frozen if p.numel() > persistence_threshold]
    trainable_count = len(params)
    params = [*params, *(p for _, p in sharded_frozen)]
    names = [*names, *(n for n, _ in sharded_frozen)]
    group_of = [*group_of, *([FROZEN_GROUP] * len(sharded_frozen))]
    index_of = {id(p): i for i, p in enumerate(params)}
    owner: dict[int, str] = {}
    blocks = _block_modules(model)
    for block_name, block in blocks:
        for p in (*block.parameters(), *_external_parameters(block)):
            if id(p) in index_of:
                owner[id(p)] = ROOT if owner.get(id(p), block_name) != block_name else block_name
    in_blocks = {id(m) for _, block in blocks for m in block.modules()}
    for module, held in list(_EXTERNAL.items()):
        if id(module) not in in_blocks:  # used by the root unit's own code: gathered for all of forward
            owner.update({id(p): ROOT for p in held})
    unit_order = [ROOT] + [name for name, _ in blocks]
    module_of = {ROOT: model, **dict(blocks)}
    members: dict[tuple[str, int, bool], list[int]] = {}
    persistent: list[int] = []
    for i, p in enumerate(params):
        if p.numel() <= persistence_threshold:
            persistent.append(i)
        else:
            members.setdefault((owner.get(id(p), ROOT), group_of[i], i in experts), []).append(i)

    builder = LayoutBuilder(params, names, world_size)
    units: list[Unit] = []

    def bucket_of(indices: list[int], group: int, frozen_ones: bool = False) -> int:
        spread = experts_world_size if indices[0] in experts else 0
        return builder.add(indices, group, frozen_ones, experts_world_size=spread)

    def add_units(frozen_ones: bool) -> None:
        # Blocks in reverse (the order backward produces their gradients), the root unit last.
        for unit_name in reversed(unit_order):
            for (name, group, _), indices in sorted(members.items(), key=lambda kv: kv[0][1:]):
                if name == unit_name and (group == FROZEN_GROUP) == frozen_ones:
                    units.append(Unit(name, module_of[name], bucket_of(indices, group, frozen_ones)))

    add_units(frozen_ones=False)
    kind = [(group_of[i], i in experts) for i in range(len(params))]
    persistent_buckets = [bucket_of(run, group_of[run[0]]) for run in
                          (runs_by_kind if interleaved_groups else size_runs)(
                              reversed(persistent), [p.numel() for p in params], kind, bucket_numel)]
    add_units(frozen_ones=True)  # after every trainable bucket
    assert all(i < trainable_count for i in persistent)
    return Stage3Plan(builder.layout(), tuple(units), frozenset(persistent_buckets), tuple(params), tuple(names))


def unit_label(unit: Unit, layout: FlatLayout) -> str:
    """A collective label that names the unit and its parameters (for errors and the profiler)."""
    slots = layout.buckets[unit.bucket_index].slots
    shown = ", ".join(s.name for s in slots[:4]) + (", ..." if len(slots) > 4 else "")
    return f"gather[{unit.name}: {shown}]"

