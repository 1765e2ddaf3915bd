"""Muon (and Adafactor): which parameters a whole-matrix optimizer steps, DeepSpeed's ``Muon`` type,
and the inner torch optimizer each group's owned matrices get (see [Note: whole matrices, each on one
rank] in optim/whole_matrices.py).

[Note: DeepSpeed's Muon split]
DeepSpeed's ``"optimizer": {"type": "Muon"}`` steps the hidden matrices by Muon and everything else by
Adam: a parameter is Muon's when its ``use_muon`` attribute says so, and DeepSpeed's ``initialize``
sets that attribute itself, True for every parameter of two or more dimensions whose name contains
neither ``embed`` nor ``lm_head``.  zeroshard reads a ``use_muon`` the user set (before ``Init``
adoption too) and otherwise applies the same rule, without setting attributes on the user's tensors:
the split becomes two parameter groups per original group, marked ``use_muon`` as DeepSpeed's are.
The keys are DeepSpeed's: ``lr``, ``momentum``, ``weight_decay``, ``ns_method`` for Muon (``muon_lr``
overrides ``lr``), ``lr``, ``betas``, ``eps``, ``weight_decay`` for Adam (``adam_lr`` overrides
``lr``), with DeepSpeed's defaults (Muon lr 0.02, momentum 0.95; Adam lr 3e-4, betas (0.9, 0.95),
eps 1e-10; weight decay 0).  The matrices are stepped by ``torch.optim.Muon`` with Nesterov momentum and
``adjust_lr_fn="original"`` (the update scaled by sqrt(max(1, rows/cols)), DeepSpeed's scale); its
momentum ``B = mu B + g`` is DeepSpeed's ``B = mu B + (1 - mu) g`` times 1/(1 - mu), which the
Newton-Schulz normalisation removes.  Both of DeepSpeed's ``ns_method`` values name the same quintic
polynomial with the same coefficients ("gram" evaluates it on the Gram matrix, which saves flops on
wide matrices, "standard" directly): zeroshard evaluates it as torch does; any other value is refused
when the config is read.  The rest is stepped by torch's AdamW (fused), DeepSpeed's Adam update.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch
from torch import nn

from ..config.schema import OptimizerConfig
from ..config.spec_params import OPTIMIZER_PARAMS, resolve
from .param_groups import TrainableParams
from .matrix_state import ChunkedState, FactoredState
from .whole_matrices import InnerSpec, WholeMatrixError

#: torch.optim.Muon's own options, copied from an engine group into the owner's optimizer at each step
TORCH_MUON_DEFAULTS: dict[str, Any] = {"nesterov": True, "ns_coefficients": (3.4445, -4.7750, 2.0315), "eps": 1e-7,
                                       "ns_steps": 5, "adjust_lr_fn": "original"}
#: DeepSpeed's Newton-Schulz methods (the same polynomial: see [Note: DeepSpeed's Muon split])
NS_METHODS = ("gram", "standard")
#: Muon's state, shaped as the parameter
MUON_STATE = ChunkedState(("momentum_buffer",))
_MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
_ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
#: DeepSpeed's names in a parameter's name that keep a matrix with Adam
_ADAM_NAMES = ("embed", "lm_head")


class NoMatrixError(WholeMatrixError):
    """Muon was asked for, and no trainable parameter is a matrix it could step."""


class UseMuonMarkError(WholeMatrixError):
    """A ``use_muon`` mark on a parameter Muon cannot step (fewer than two dimensions)."""


def read_marks(model: nn.Module) -> dict[int, bool]:
    """``id(param)`` -> the ``use_muon`` mark the user set on it (read, never set)."""
    return {id(p): bool(getattr(p, "use_muon")) for p in model.parameters() if hasattr(p, "use_muon")}


def adopted_marks(marks: Mapping[int, bool], replaced: Mapping[int, nn.Parameter]) -> dict[int, bool]:
    """The marks, keyed by the parameters that stand for the ones built under ``zeroshard.Init``."""
    out = dict(marks)
    for old, new in replaced.items():
        if old in marks:
            out[id(new)] = marks[old]
    return out


def is_muon_param(name: str, param: nn.Parameter, marks: Mapping[int, bool]) -> bool:
    """The user's mark, else DeepSpeed's rule (see [Note: DeepSpeed's Muon split])."""
    mark = marks.get(id(param))
    if mark is None:
        return param.dim() >= 2 and not any(k in name.lower() for k in _ADAM_NAMES)
    if mark and param.dim() < 2:
        raise UseMuonMarkError(f"parameter {name!r} (shape {tuple(param.shape)}) is marked use_muon = True, but "
                               f"Muon steps matrices only; set use_muon = False on it (it is then stepped by Adam)")
    return mark


def split_for_muon(trainable: TrainableParams, marks: Mapping[int, bool]) -> TrainableParams:
    """Each parameter group cut in two, Muon's matrices and the rest, each marked ``use_muon``."""
    flags = [is_muon_param(n, p, marks) for n, p in zip(trainable.names, trainable.params)]
    if not any(flags):
        raise NoMatrixError("the optimizer is Muon, and no trainable parameter is a hidden matrix it can step "
                            "(2-D or more, named neither embed nor lm_head, or marked use_muon = True); use "
                            "AdamW, or mark the matrices use_muon = True")
    index: dict[tuple[int, bool], int] = {}
    options: list[dict[str, Any]] = []
    group_of: list[int] = []
    for g, flag in zip(trainable.group_of, flags):
        if (g, flag) not in index:
            index[(g, flag)] = len(options)
            options.append({**trainable.group_options[g], "use_muon": flag})
        group_of.append(index[(g, flag)])
    return TrainableParams(trainable.params, trainable.names, group_of, options, trainable.frozen)


def config_split(trainable: TrainableParams, config: Optional[OptimizerConfig], marks: Mapping[int, bool],
                 replaced: Mapping[int, nn.Parameter]) -> TrainableParams:
    """The groups the config's optimizer steps: its ``Muon``'s split (see [Note: DeepSpeed's Muon
    split]; ``marks`` as read before ``Init``'s parameters were ``replaced``), else as they are."""
    if config is None or config.type != "Muon":
        return trainable
    return split_for_muon(trainable, adopted_marks(marks, replaced))


class MuonWithAuxAdam(torch.optim.AdamW):
    """DeepSpeed's ``MuonWithAuxAdam``: parameter groups marked ``use_muon`` (True: Muon, False: AdamW).

    Groups without the mark are AdamW's.  Within an engine, the ``use_muon`` groups' chunks are never
    stepped here: each of their matrices is stepped whole by ``torch.optim.Muon`` on the rank that owns
    it (see [Note: whole matrices, each on one rank] in optim/whole_matrices.py); this optimizer steps
    the rest and holds every group's hyperparameters (the LR schedule's, the checkpoint's).  Outside an
    engine it refuses to step a ``use_muon`` group (pass the model's parameters to ``initialize``).
    """

    def __init__(self, param_groups: Iterable[dict[str, Any]], fused: Optional[bool] = None) -> None:
        groups = []
        for group in param_groups:
            group = dict(group)
            if group.get("use_muon", False):
                group.pop("betas", None)
                group = {**_MUON_DEFAULTS, **TORCH_MUON_DEFAULTS, **group}
                if group["ns_method"] not in NS_METHODS:
                    raise WholeMatrixError(f"ns_method {group['ns_method']!r} is not one of {', '.join(NS_METHODS)}")
            else:
                group = {**_ADAM_DEFAULTS, **group, "use_muon": False}
            groups.append(group)
        super().__init__(groups, fused=fused)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            if group["use_muon"] and any(p.grad is not None for p in group["params"]):
                raise WholeMatrixError("MuonWithAuxAdam steps its use_muon groups only inside a zeroshard engine, "
                                       "each matrix whole on the rank that owns it; pass the model's parameters to "
                                       "zeroshard.initialize() with this optimizer")
        return super().step(closure)


def muon_inner(params: list[nn.Parameter], options: dict[str, Any]) -> torch.optim.Optimizer:
    """torch.optim.Muon over an owner's whole matrices of one ``use_muon`` group."""
    keys = ("lr", "weight_decay", "momentum", *TORCH_MUON_DEFAULTS)
    return torch.optim.Muon(params, **{k: options[k] for k in keys if k in options})


def _same_class(optimizer: torch.optim.Optimizer) -> Any:
    cls = type(optimizer)

    def build(params: list[nn.Parameter], options: dict[str, Any]) -> torch.optim.Optimizer:
        return cls(params, **{k: v for k, v in options.items() if k in optimizer.defaults})
    return build


def whole_matrix_groups(optimizer: torch.optim.Optimizer) -> dict[int, InnerSpec]:
    """Group index -> how its parameters are stepped whole, for the groups of ``optimizer`` that need
    whole matrices (none for every other optimizer)."""
    if isinstance(optimizer, MuonWithAuxAdam):
        return {i: InnerSpec(muon_inner, state=MUON_STATE) for i, g in enumerate(optimizer.param_groups)
                if g.get("use_muon")}
    if isinstance(optimizer, torch.optim.Muon):
        return {i: InnerSpec(_same_class(optimizer), state=MUON_STATE) for i in range(len(optimizer.param_groups))}
    if isinstance(optimizer, torch.optim.Adafactor):
        return {i: InnerSpec(_same_class(optimizer), as_matrix=False, state=FactoredState())
                for i in range(len(optimizer.param_groups))}
    return {}


def from_muon_config(params: dict, groups: list[dict[str, Any]]) -> MuonWithAuxAdam:
    """The config's ``Muon``: DeepSpeed's keys given to the groups of their kind (see [Note: DeepSpeed's
    Muon split])."""
    full = {k: v for k, v in resolve(params, OPTIMIZER_PARAMS["Muon"], "optimizer.params (Muon)").items()
            if v is not None}
    muon = {k: full[k] for k in ("lr", "momentum", "weight_decay", "ns_method") if k in full}
    adam = {k: full[k] for k in ("lr", "betas", "eps", "weight_decay") if k in full}
    if "muon_lr" in full:
        muon["lr"] = full["muon_lr"]
    if "adam_lr" in full:
        adam["lr"] = full["adam_lr"]
    if "betas" in adam:
        adam["betas"] = tuple(adam["betas"])
    return MuonWithAuxAdam([{**g, **(muon if g.get("use_muon") else adam)} for g in groups], fused=True)
