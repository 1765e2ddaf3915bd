"""Weights shared by several pipeline stages (``TiedLayerSpec``): one value, one gradient, one update.

[Note: tied weights across stages]
A tied weight is a parameter of the first stage that uses it, its owner, trained there by that
stage's ZeRO engine like any other parameter; every later stage that uses it holds a full copy, a
plain tensor its engine never sees.  Each copy accumulates its gradient over the batch's
micro-batches.  The owner must add those sums to its own gradient before its engine reduces the
gradients over the data-parallel group, which it does during the backward of its last micro-batch;
the copies' stages finish their last backward before the owner starts its own (their backward feeds
it), so each of them all-reduces its sum with the owner's stage right after its last backward, and
the owner joins that all-reduce right before its last backward and adds the result to the gradient
as it arrives (a hook on the parameter).  After the optimizer step the owner's new values are
broadcast to the copies.  The ranks enter these collectives key by key in one order, so none waits
on a rank that waits on it.  Only the owner's engine holds the weight: the global gradient norm
counts it once and its optimizer state exists once.  A copy is full-size on its stage whatever the
ZeRO stage: it is not sharded.

[Note: tied copies under mixed precision]
With bf16 the owner's engine keeps the fp32 master and computes with the 16-bit parameter; each copy
is kept in that compute dtype, so a later stage computes with exactly the owner's 16-bit values (the
broadcast sends them).  A copy's gradient is summed over the micro-batches in fp32, as the engine
sums its own parameters' gradients, not in 16 bits: each micro-batch's gradient is moved into an fp32
sum as soon as autograd has accumulated it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.parallel_dims import ParallelGroups
from ..sharding.stage3.placeholder import ShardedParameterPlaceholder
from ..sharding.storage import HOMES


@dataclass
class TiedWeight:
    """One key: the stages that use it (ascending), and on this rank's stage its module and copy."""

    key: str
    stages: tuple[int, ...]
    attr: str
    shape: torch.Size
    #: the module built for the key on this stage (None: this stage does not use the key)
    module: Optional[nn.Module] = None
    #: a later stage's copy of the weight, a leaf tensor outside the engine (None on the owner)
    copy: Optional[torch.Tensor] = None
    #: a 16-bit copy's gradient summed over the batch's micro-batches, in fp32 (see [Note: tied copies
    #: under mixed precision])
    grad_sum: Optional[torch.Tensor] = None

    @property
    def owner(self) -> int:
        return self.stages[0]


class TiedWeights:
    """Every tied key of a pipeline, kept as [Note: tied weights across stages] says."""

    def __init__(self, groups: ParallelGroups, ties: list[TiedWeight]) -> None:
        self.groups = groups
        self.ties = sorted(ties, key=lambda t: t.key)
        for tie in self.ties:  # every rank creates every key's group, in key order
            if len(tie.stages) > 1:
                groups.subpipeline(tie.stages)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def _shared_here(self) -> list[TiedWeight]:
        """The keys this stage shares with another stage."""
        return [t for t in self.ties if len(t.stages) > 1 and self.groups.stage in t.stages]

    def _group(self, tie: TiedWeight) -> Optional[dist.ProcessGroup]:
        return self.groups.subpipeline(tie.stages)

    def detach_copies(self) -> None:
        """On the later stages, replace each tied parameter by a plain leaf tensor (the copy)."""
        for tie in self._shared_here():
            if tie.owner != self.groups.stage and tie.module is not None:
                param = getattr(tie.module, tie.attr)
                delattr(tie.module, tie.attr)
                tie.copy = param.detach().clone().requires_grad_(True)
                setattr(tie.module, tie.attr, tie.copy)

    def use_compute_dtype(self, dtype: torch.dtype) -> None:
        """Keep every copy in ``dtype`` (mixed precision; see [Note: tied copies under mixed precision])."""
        for tie in self._shared_here():
            if tie.copy is None or tie.copy.dtype == dtype:
                continue
            assert tie.module is not None
            tie.copy = tie.copy.detach().to(dtype).requires_grad_(True)
            setattr(tie.module, tie.attr, tie.copy)
            tie.copy.register_post_accumulate_grad_hook(lambda copy, tie=tie: self._sum_in_fp32(tie, copy))

    @staticmethod
    def _sum_in_fp32(tie: TiedWeight, copy: torch.Tensor) -> None:
        assert copy.grad is not None
        grad = copy.grad.float()
        tie.grad_sum = grad if tie.grad_sum is None else tie.grad_sum.add_(grad)
        copy.grad = None

    def broadcast_from_owners(self, read_owner: Callable[[nn.Module, str], torch.Tensor]) -> None:
        """The owner's values into every copy (``read_owner(module, attr)``: the full values of the module's
        parameter ``attr`` on the owner, read by name: at ZeRO stage 3 the module holds the parameter
        itself only while it is gathered)."""
        for tie in self._shared_here():
            if tie.owner == self.groups.stage:
                assert tie.module is not None
                values = read_owner(tie.module, tie.attr).detach().float().contiguous()
            else:
                assert tie.copy is not None
                values = torch.empty(tie.shape, dtype=torch.float32, device=tie.copy.device)
            dist.broadcast(values, group_src=0, group=self._group(tie))
            if tie.copy is not None:
                with torch.no_grad():
                    tie.copy.copy_(values)

    def before_last_backward(self) -> None:
        """Owner: receive the copies' gradient sums and add them to the coming backward's gradient."""
        for tie in self._shared_here():
            if tie.owner != self.groups.stage:
                continue
            assert tie.module is not None
            param = _trained(getattr(tie.module, tie.attr))
            summed = torch.zeros(tie.shape, dtype=torch.float32, device=self.groups.world.device)
            dist.all_reduce(summed, group=self._group(tie))
            self._hooks.append(param.register_hook(lambda grad, extra=summed: grad + extra.to(grad.dtype)))

    def after_last_backward(self) -> None:
        """Owner: drop the hooks; later stages: send each copy's gradient sum to the owner, then clear it."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for tie in self._shared_here():
            if tie.owner == self.groups.stage:
                continue
            assert tie.copy is not None
            grad = tie.grad_sum if tie.grad_sum is not None else tie.copy.grad
            summed = grad.detach().float().contiguous() if grad is not None else torch.zeros(
                tie.shape, dtype=torch.float32, device=tie.copy.device)
            dist.all_reduce(summed, group=self._group(tie))
            tie.copy.grad = None
            tie.grad_sum = None


def _trained(param: nn.Parameter) -> nn.Parameter:
    """The parameter autograd accumulates into: at ZeRO stage 3 a module shows a placeholder for it while
    its unit is released (between passes), and a hook must go on the parameter itself (see [Note: reading
    a sharded parameter outside forward] in sharding/stage3/placeholder.py)."""
    if isinstance(param, ShardedParameterPlaceholder):
        home = HOMES.home_of(param)
        assert home is not None, "a placeholder of a closed engine"
        return home.storage.params[param.ds_id]
    return param
