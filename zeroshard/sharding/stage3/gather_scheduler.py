"""When stage 3 gathers, prefetches and releases each unit, driven by module hooks.

- A unit is gathered by its module's forward pre-hook, and again, for backward, by a hook on its
  outputs' gradients (which fires just before the gradient flows into the module).
- It is released after its module's forward, and after backward has produced all its gradients,
  unless the recorded execution order says it is needed again soon (``stage3_max_reuse_distance``).
- Each use looks ahead in the order recorded on an earlier pass and starts the all-gathers of the next
  units (the next one whatever its size, more up to ``stage3_prefetch_bucket_size`` elements,
  ``stage3_max_live_parameters`` in all; see [Note: the next unit is always prefetched]).

[Note: recorded order and divergence]
The order is recorded per mode (train/eval, grad enabled or not), from one ``engine.forward`` to the
next.  Prefetch only follows the recorded order while the current pass matches it so far; the
moment they differ it stops, and at the end of the pass the new order replaces the old one (it is
re-recorded).  A wrong guess only costs a gather that was not needed (released at the end of
backward); it can never deadlock, because every rank makes the same guesses from the same program.
Ranks whose control flow differs (a module run on one rank only, experts chosen by the data) agree on
each gather instead of issuing it (see [Note: ranks agree on every gather] in
sharding/stage3/gather_agreement.py): prefetch then happens inside those rounds.

[Note: stage-3 hooks run outside compiled regions]
Under ``torch.compile`` the gather, prefetch and release hooks run eagerly, each wrapped in
``torch.compiler.disable``; only the modules' own computation is traced.  Traced, a post-forward
hook's release would put a :class:`ShardedParameterPlaceholder` in the module while dynamo still
holds the module's attributes, and dynamo would read it back as an input of the graph it builds
(and fail on its meta storage).  In a larger world the agreement rounds are collectives that dynamo
stops tracing at before it reaches a release, which is why only a world of one met it; the
collectives' bookkeeping (``zlib.crc32`` digests) is no more traceable.  The hooks are also state
machines over Python containers (the recorded order, the gather states) whose every branch would
become a guard and a recompilation.  Eager, they swap each unit's parameters exactly as without
compilation, and the traced forward reads a unit's real parameters, the same objects on every pass,
so its guards hold from one step to the next.  The price: a frame that calls a unit runs eager
(dynamo does not resume a graph inside the loop over a module's hooks), and each unit's own forward
is compiled as a graph of its own.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten

from ...config import ZeroConfig
from .gather_agreement import ROW_WIDTH, GatherAgreement
from .sharded_params import GatherState, ShardedParameters
from .units import Unit, unit_label


class GatherScheduler:
    """Owns the stage-3 module hooks and the gather/prefetch/release decisions."""

    def __init__(self, storage: ShardedParameters, units: tuple[Unit, ...], zero: ZeroConfig,
                 model: torch.nn.Module, agreement: Optional[GatherAgreement] = None) -> None:
        self.storage = storage
        self.model = model
        self.units = {u.bucket_index: u for u in units}
        self.zero = zero
        self._numel = {u.bucket_index: storage.layout.buckets[u.bucket_index].padded_numel for u in units}
        self._labels = {u.bucket_index: unit_label(u, storage.layout) for u in units}
        self.recorded: dict[tuple[bool, bool], list[int]] = {}
        self.current: list[int] = []
        self._key: tuple[bool, bool] = (True, True)
        self._handles: list[Any] = []
        #: None in a world of one rank: each gather is issued at once
        self.agreement = agreement
        #: the units this rank's last forward used: the ones its backward will ask for
        self._used_in_forward: set[int] = set()
        eager = torch.compiler.disable  # see [Note: stage-3 hooks run outside compiled regions]
        for unit in units:
            self._handles.append(unit.module.register_forward_pre_hook(eager(self._pre_forward_hook(unit))))
            self._handles.append(unit.module.register_forward_hook(eager(self._post_forward_hook(unit))))
        if agreement is not None:  # after the units' own hooks: the model's forward is over
            self._handles.append(model.register_forward_hook(eager(self._end_of_forward)))

    # ------------------------------------------------------------------ hooks
    def _pre_forward_hook(self, unit: Unit) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self.use(unit.bucket_index)
        return hook

    def _post_forward_hook(self, unit: Unit) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self.in_backward():
                return  # a checkpoint's recomputation: backward is about to use the parameters
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._pre_backward_hook(unit))
                if self.storage.layout.buckets[unit.bucket_index].frozen:
                    self._release_after_backward(unit, args)
            self.done_with(unit.bucket_index)
        return hook

    def _release_after_backward(self, unit: Unit, args: Any) -> None:
        """A frozen unit gets no gradient to say that backward is done with it: release it once the
        gradients of the module's inputs are computed (its backward is then over).  A module whose
        inputs need no gradient keeps its frozen unit until the end of backward."""
        inputs = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if inputs:
            torch.autograd.graph.register_multi_grad_hook(
                inputs, lambda grads: self.done_with(unit.bucket_index), mode="all")

    def _pre_backward_hook(self, unit: Unit) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if self.storage.state[unit.bucket_index] is not GatherState.GATHERED or not self._used_last(unit):
                self.use(unit.bucket_index)
        return hook

    @staticmethod
    def in_backward() -> bool:
        """True inside autograd's backward, where a forward hook can only be activation
        checkpointing recomputing a region (see zeroshard/activations/checkpointing.py)."""
        return torch._C._current_graph_task_id() != -1

    def _used_last(self, unit: Unit) -> bool:
        return bool(self.current) and self.current[-1] == unit.bucket_index

    # ------------------------------------------------------------------ decisions
    def begin_pass(self) -> None:
        """A new forward starts: close the previous pass's order and start a new one."""
        self._close_pass()
        self._key = (torch.is_grad_enabled(), self.model.training)
        self.current = []

    def _close_pass(self) -> None:
        if self.current:
            self.recorded[self._key] = self.current

    def use(self, index: int) -> None:
        """The unit is about to compute: make sure it is gathered, then prefetch what comes next."""
        self.current.append(index)
        if not self.in_backward():
            self._used_in_forward.add(index)
        if self.agreement is None:
            self.storage.gather(index, self._labels[index], compute=True)
            # the unit borrows this rank's chunk: [Note: a gathered unit borrows this rank's chunk] in
            # sharding/stage3/sharded_params.py
            self.storage.lend_chunk(index)
            for ahead in self._prefetch_candidates():
                self.storage.gather(ahead, self._labels[ahead], async_op=True, compute=True)
            return
        if self.storage.state[index] is GatherState.SHARDED:
            wanted = [index, *self._prefetch_candidates()[:ROW_WIDTH - 1]]
            self._gather_agreed(self.agreement.request(wanted), keep=set(wanted))
        else:  # gathered ahead: a round of prefetches only when the next unit is not on its way yet
            coming = self._prefetch_candidates()
            if coming and coming[0] == self._next_in_order():
                wanted = coming[:ROW_WIDTH - 1]
                self._gather_agreed(self.agreement.request(wanted), keep=set(wanted))
        self.storage.wait(index)
        self.storage.lend_chunk(index)

    def _prefetch_candidates(self) -> list[int]:
        """The units the recorded order says come next, within the prefetch budgets.

        [Note: the next unit is always prefetched]
        ``stage3_prefetch_bucket_size`` bounds how far ahead gathers run, not which unit may be
        prefetched: the next unit is prefetched whatever its size (a transformer block of a 7B model
        is some 2e8 elements, four times DeepSpeed's default budget of 5e7), else a model whose units
        are larger than the budget would never overlap a gather with compute; the budget then limits
        the units after it.  ``stage3_max_live_parameters`` bounds them all, the next one included, and
        a budget of 0 turns prefetching off.
        """
        budget = self.zero.stage3_prefetch_bucket_size
        trace = self.recorded.get(self._key)
        position = len(self.current)
        if not budget or trace is None or trace[:position] != self.current:
            return []
        live = self.live_numel()
        chosen: list[int] = []
        for index in trace[position:]:
            if self.storage.state[index] is not GatherState.SHARDED or index in chosen:
                continue
            numel = self._numel[index]
            if (chosen and numel > budget) or live + numel > self.zero.stage3_max_live_parameters:
                break
            chosen.append(index)
            budget -= numel
            live += numel
        return chosen

    def _next_in_order(self) -> Optional[int]:
        """The unit the recorded order uses next, while this pass follows it."""
        trace = self.recorded.get(self._key)
        position = len(self.current)
        if trace is None or position >= len(trace) or trace[:position] != self.current:
            return None
        return trace[position]

    # ------------------------------------------------------------------ agreed gathers
    def _gather_agreed(self, units: list[int], keep: set[int]) -> None:
        """Gather every unit a round agreed on, in its order; release at once the ones gathered only
        for other ranks (a backward keeps those its forward used: it will ask for them)."""
        if self.in_backward():
            keep = keep | self._used_in_forward
        fresh = []
        for index in units:
            if self.storage.state[index] is GatherState.SHARDED:
                self.storage.gather(index, self._labels[index], async_op=True, compute=True)
                fresh.append(index)
            else:
                self.storage.join_gather(index, self._labels[index])
        for index in fresh:
            if index not in keep:
                self.storage.release(index)

    def _end_of_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.in_backward():
            self.finish_pass()

    def finish_pass(self) -> None:
        """This rank's forward or backward is over: answer the other ranks' rounds until theirs is.
        Not while ``GatheredParameters`` holds every unit: no rank gathers then, and one rank alone may
        compute (generation on rank 0 inside the block)."""
        if self.agreement is not None and not all(self.storage.pinned(index) for index in self.units):
            self.agreement.finish(lambda units: self._gather_agreed(units, keep=set()))

    def done_with(self, index: int) -> None:
        """The unit finished a use: release it unless the recorded order reuses it soon."""
        if not self._reused_soon(index):
            self.storage.release(index)

    def _reused_soon(self, index: int) -> bool:
        trace = self.recorded.get(self._key)
        position = len(self.current)
        if trace is None or trace[:position] != self.current:
            return False
        distance = 0
        for upcoming in trace[position:]:
            if upcoming == index:
                return (distance < self.zero.stage3_max_reuse_distance
                        and self.live_numel() <= self.zero.stage3_max_live_parameters)
            distance += self._numel[upcoming]
        return False

    def live_numel(self) -> int:
        return sum(n for i, n in self._numel.items() if self.storage.state[i] is not GatherState.SHARDED)

    def release_all(self) -> None:
        """End of backward (or of an eval pass): nothing stays gathered."""
        for index in self.units:
            self.storage.release(index)
        self._used_in_forward = set()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
