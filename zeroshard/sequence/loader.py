"""The data-loader adapter of the Hugging Face path (DeepSpeed's ``UlyssesSPDataLoaderAdapter``): each
batch's sequences cut over the ranks of a sequence-parallel group.

[Note: the adapter's order of batches]
The ranks of a group each draw a batch from their own loader; the adapter gathers the group's batches
and hands them out one after the other, each cut over the group: at the i-th step of a round every rank
of the group holds its slice of the batch rank i drew.  A round of P steps thus trains on what P
data-parallel ranks would have drawn in one step, and the adapter's length is the loader's times P.
Every batch is cut along dimension 1 (the sequence) into the positions ``sequence_positions`` gives rank
r: the r-th of P consecutive slices, or, when the live engine's ring runs with
``sequence_parallel.load_balance``, chunks r and 2P - 1 - r of 2P, the layout the ring computes in
([Note: head-tail sharding balances the causal ring] in sequence/ring.py); the mode is asked for at every
refill, as the attention asks at every forward.  Before the cut the labels are shifted by one position
(``shift_labels``: the label of position t is the token at t + 1, the last position's -100), because a
slice's last position predicts the first token of the next slice, which the slice does not hold; a
model's loss must then take ``shift_labels`` as they are (transformers' ``loss_function(...,
shift_labels=...)`` does).  A batch whose length does not cut into those slices, or without
``position_ids``, is refused on every rank alike: the checks run on what the group gathered.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

from ..distributed.collectives import Collectives
from .groups import SequenceParallelError, sequence_attention, sequence_collectives
from .ring import sequence_positions

__all__ = ["UlyssesSPDataLoaderAdapter", "shift_labels"]

IGNORE_INDEX = -100


def shift_labels(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """The label each position predicts: ``labels`` moved one position left, the last ``ignore_index``."""
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


class UlyssesSPDataLoaderAdapter:
    """A loader of dict batches (``input_ids``, ``labels``, ``position_ids``, more keys allowed: tensors
    ``[b, s, ...]``, anything else JSON-serialisable) whose batches come out cut over the sequence group,
    DeepSpeed's signature ([Note: the adapter's order of batches]).  Each batch comes out with
    ``shift_labels`` instead of ``labels``, its tensors this rank's slice, on the CPU (as DeepSpeed's)."""

    def __init__(self, dl: Iterable[Any], sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl = dl
        self.sp_rank, self.sp_group, self.sp_world_size = sp_rank, sp_group, sp_world_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.iter: Iterator[Any] = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size  # type: ignore[arg-type]

    def __iter__(self) -> "UlyssesSPDataLoaderAdapter":
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """The group's next batches, cut; at the loader's end the iterator starts over (the next epoch)
        and ``StopIteration`` ends this one."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        comm = sequence_collectives(self.sp_group, self.device)
        if comm is None:
            raise SequenceParallelError("UlyssesSPDataLoaderAdapter: no sequence-parallel group (sp_group=None "
                                        "and no engine with sequence_parallel_size)")
        balanced = sequence_attention().balanced
        for gathered in _gather_batches(comm, batch, self.device, balanced):
            self.micro_batches.append(self._cut(gathered, balanced))

    def _cut(self, batch: dict[str, Any], balanced: bool) -> dict[str, Any]:
        positions = sequence_positions(batch["input_ids"].shape[1], self.sp_rank, self.sp_world_size, balanced)
        out = {k: v for k, v in batch.items() if k != "labels"}
        out["shift_labels"] = shift_labels(batch["labels"])
        for key, value in out.items():
            if isinstance(value, Tensor):
                out[key] = value[:, positions.to(value.device)].cpu().contiguous()
        return out


def _describe(batch: Any) -> dict[str, Any]:
    """What the group must agree on before any tensor moves: each key's shape and dtype, or its value
    (an ``error`` instead where the batch cannot be described, so that every rank still joins)."""
    if not isinstance(batch, dict):
        return {"error": f"a batch is a {type(batch).__name__}, not a dict"}
    described: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, Tensor):
            described[key] = {"shape": list(value.shape), "dtype": str(value.dtype)}
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            return {"error": f"{key!r} is neither a tensor nor JSON-serialisable ({type(value).__name__})"}
        described[key] = {"value": value}
    return described


def _check(described: list[dict[str, Any]], size: int, balanced: bool) -> None:
    """Refuse, on every rank alike, batches the group cannot cut: the reasons are named per rank."""
    for rank, batch in enumerate(described):
        if "error" in batch and isinstance(batch["error"], str):
            raise SequenceParallelError(f"UlyssesSPDataLoaderAdapter: rank {rank} of the group: {batch['error']}")
        missing = [k for k in ("input_ids", "labels", "position_ids") if k not in batch]
        if missing:
            raise SequenceParallelError(
                f"UlyssesSPDataLoaderAdapter: rank {rank} of the group drew a batch without {', '.join(missing)}; "
                f"Ulysses needs input_ids, labels and position_ids (each position's place in its sequence, "
                f"arange(seq_len) per sample unless sequences are packed)")
        length, parts = batch["input_ids"]["shape"][1], 2 * size if balanced else size
        if length % parts:
            cut = f"into the {parts} chunks of sequence_parallel.load_balance" if balanced else \
                f"over sequence_parallel_size {size}"
            raise SequenceParallelError(
                f"UlyssesSPDataLoaderAdapter: rank {rank} of the group drew a batch of sequence length {length}, "
                f"which does not split {cut}: pad the batches to a multiple of {parts}")
        first = described[0]
        if sorted(batch) != sorted(first) or any(("shape" in batch[k]) != ("shape" in first[k])
                                                 or batch[k].get("dtype") != first[k].get("dtype") for k in batch):
            raise SequenceParallelError(
                f"UlyssesSPDataLoaderAdapter: rank {rank} of the group drew a batch whose keys or dtypes differ from "
                f"rank 0's ({sorted(batch)} against {sorted(first)})")
        for key, meta in batch.items():
            if "shape" in meta and meta["shape"][:2] != batch["input_ids"]["shape"][:2]:
                raise SequenceParallelError(
                    f"UlyssesSPDataLoaderAdapter: rank {rank} of the group: {key!r} of shape {meta['shape']} does "
                    f"not start with input_ids' [batch, sequence] {batch['input_ids']['shape'][:2]}")
            if "shape" in meta and [meta["shape"][0]] + meta["shape"][2:] != \
                    [first[key]["shape"][0]] + first[key]["shape"][2:]:
                raise SequenceParallelError(
                    f"UlyssesSPDataLoaderAdapter: rank {rank} of the group: {key!r} of shape {meta['shape']} differs "
                    f"from rank 0's {first[key]['shape']} elsewhere than along the sequence")


def _gather_batches(comm: Collectives, batch: Any, device: torch.device, balanced: bool) -> list[dict[str, Any]]:
    """Every rank of the group's batch, in rank order, on every rank of it."""
    size = comm.world.world_size
    described = comm.all_gather_json(_describe(batch), "sequence_batch_keys")
    _check(described, size, balanced)
    gathered: list[dict[str, Any]] = [{} for _ in range(size)]
    for key, meta in described[0].items():
        if "shape" not in meta:
            for rank in range(size):
                gathered[rank][key] = described[rank][key]["value"]
            continue
        for rank, tensor in enumerate(_gather_tensor(comm, batch[key], [d[key]["shape"] for d in described],
                                                     device)):
            gathered[rank][key] = tensor
    return gathered


def _gather_tensor(comm: Collectives, tensor: Tensor, shapes: list[list[int]], device: torch.device) -> list[Tensor]:
    """Every rank's ``tensor`` (shapes differing along the sequence only), by one all-gather of the
    tensors padded to the longest."""
    longest = max(shape[1] for shape in shapes)
    padded = torch.zeros(tensor.shape[0], longest, *tensor.shape[2:], dtype=tensor.dtype, device=device)
    padded[:, :tensor.shape[1]] = tensor.to(device)
    full = torch.empty(len(shapes) * padded.numel(), dtype=padded.dtype, device=device)
    comm.all_gather(full, padded.view(-1), "sequence_batch")
    rows = full.view(len(shapes), *padded.shape)
    return [rows[rank, :, :shape[1]] for rank, shape in enumerate(shapes)]
