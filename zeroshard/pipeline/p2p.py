"""Activations forward and gradients backward between neighbouring stages, as torch.distributed
point-to-point messages on a group of their own.

[Note: a header before every activation]
A stage does not know in advance what the stage before it produces: sequence lengths vary from one
micro-batch to the next, and a stage may hand on a tuple of tensors of different dtypes (hidden states,
a mask, position ids).  So each forward message is preceded by a header, a short int64 tensor holding
the number of tensors and, for each, its dtype, whether it needs a gradient and its shape, itself
preceded by its length.  Gradients need no header: the stage that receives them made the tensors
they belong to, and receives one gradient for each of its outputs that needs one.  Sends are
``isend`` and are waited for at the end of the batch, so a stage never blocks on a neighbour busy
with its own passes (a send found completed before then is let go at once, so that its tensor is
freed); receives block, since the pass that follows needs them.

Messages are matched in the order they are sent, per pair of ranks and direction: every schedule
runs each rank's forwards in one order of (chunk, micro-batch) and its backwards in one order, the
same on every rank (pipeline/schedule.py), so a rank receives its neighbour's activations, and its
gradients, in the order the neighbour sends them.  With one chunk per rank the activations go only
to the next stage and the gradients only to the previous one.  With virtual stages the last stage's
activations go round to the first, so two neighbours exchange activations and gradients both ways, and
the two streams, each in order on its own, interleave differently on the two sides; the gradients then
travel on a point-to-point group of their own (``ParallelGroups.gradient_p2p``), and with the tags
(one per direction) no transport can match a gradient with an activation.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist

#: the dtypes an activation may have, by code
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
_FORWARD, _BACKWARD = 1, 2  # message tags, one per direction


class ActivationTypeError(TypeError):
    """A stage's output that cannot travel to the next stage (not a tensor, or an unsupported dtype)."""


def as_tensors(value: Any, what: str) -> tuple[torch.Tensor, ...]:
    """A stage's output as a tuple of tensors."""
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if not isinstance(v, torch.Tensor):
            raise ActivationTypeError(f"{what} holds a {type(v).__name__}: stages hand each other a tensor or a "
                                      f"tuple of tensors")
        if v.dtype not in DTYPES:
            raise ActivationTypeError(f"{what} holds a tensor of dtype {v.dtype}, which cannot travel between stages")
    return values


def encode_header(values: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``[count, (dtype code, needs grad, ndim, *shape) per tensor]``."""
    fields = [len(values)]
    for v in values:
        fields += [DTYPES.index(v.dtype), int(v.requires_grad), v.dim(), *v.shape]
    return torch.tensor(fields, dtype=torch.int64)


def decode_header(header: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    fields = header.tolist()
    out, at = [], 1
    for _ in range(fields[0]):
        code, grad, ndim = fields[at:at + 3]
        out.append((DTYPES[code], bool(grad), tuple(fields[at + 3:at + 3 + ndim])))
        at += 3 + ndim
    return out


class StageLink:
    """This stage's messages to and from its neighbours in one pipeline (``group``: its p2p group,
    in which a rank's number is its stage)."""

    def __init__(self, group: Optional[dist.ProcessGroup], stage: int, num_stages: int,
                 device: torch.device, gradient_group: Optional[dist.ProcessGroup] = None) -> None:
        self.group, self.stage, self.num_stages, self.device = group, stage, num_stages, device
        #: where the gradients travel: a group of their own with virtual stages (see the module's Note)
        self.gradient_group = gradient_group if gradient_group is not None else group
        #: the neighbours, round the ranks (with virtual stages the last stage feeds the first)
        self.next, self.previous = (stage + 1) % num_stages, (stage - 1) % num_stages
        self._sends: list[tuple[Any, torch.Tensor]] = []  # each send's work and the tensor it reads
        #: seconds blocked so far in receives, and in waiting for sends (the executor's ``BatchTiming``)
        self.recv_seconds = 0.0
        self.send_seconds = 0.0

    def _group_of(self, tag: int) -> Optional[dist.ProcessGroup]:
        return self.gradient_group if tag == _BACKWARD else self.group

    def _isend(self, tensor: torch.Tensor, to: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        self._drop_completed_sends()
        self._sends.append((dist.isend(tensor, group=self._group_of(tag), group_dst=to, tag=tag), tensor))

    def _drop_completed_sends(self) -> None:
        """Let go of the sends that have completed (``wait()`` on a completed send returns at once, or
        raises its error), so that a batch's sent activations and gradients are freed as they arrive,
        not all kept until the batch's end."""
        pending = []
        for work, tensor in self._sends:
            if work.is_completed():
                work.wait()
            else:
                pending.append((work, tensor))
        self._sends = pending

    def _recv(self, tensor: torch.Tensor, source: int, tag: int) -> torch.Tensor:
        work = dist.irecv(tensor, group=self._group_of(tag), group_src=source, tag=tag)
        assert work is not None  # None only for a rank outside the group
        started = time.perf_counter()
        work.wait()
        self.recv_seconds += time.perf_counter() - started
        return tensor

    def send_forward(self, values: tuple[torch.Tensor, ...]) -> None:
        """The stage's output to the next stage, header first."""
        header = encode_header(values).to(self.device)
        self._isend(torch.tensor([header.numel()], dtype=torch.int64, device=self.device), self.next, _FORWARD)
        self._isend(header, self.next, _FORWARD)
        for v in values:
            self._isend(v, self.next, _FORWARD)

    def recv_forward(self, training: bool) -> tuple[torch.Tensor, ...]:
        """The previous stage's output; ``training``: those tensors that need a gradient are leaves that
        will receive it."""
        length = self._recv(torch.empty(1, dtype=torch.int64, device=self.device), self.previous, _FORWARD)
        header = self._recv(torch.empty(int(length.item()), dtype=torch.int64, device=self.device),
                            self.previous, _FORWARD)
        out = []
        for dtype, needs_grad, shape in decode_header(header):
            value = self._recv(torch.empty(shape, dtype=dtype, device=self.device), self.previous, _FORWARD)
            out.append(value.requires_grad_(needs_grad and training))
        return tuple(out)

    def send_backward(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """The gradients of the inputs that needed one, to the previous stage (zeros where unused)."""
        for value in inputs:
            if value.requires_grad:
                grad = value.grad if value.grad is not None else torch.zeros_like(value)
                self._isend(grad, self.previous, _BACKWARD)

    def recv_backward(self, outputs: tuple[torch.Tensor, ...]) -> list[Optional[torch.Tensor]]:
        """The next stage's gradients of this stage's outputs (None for an output that needs none)."""
        return [self._recv(torch.empty_like(o), self.next, _BACKWARD) if o.requires_grad else None
                for o in outputs]

    def wait_sends(self) -> None:
        started = time.perf_counter()
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self.send_seconds += time.perf_counter() - started
