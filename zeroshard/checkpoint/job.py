"""One checkpoint of a job whose model is trained in parts (pipeline stages), each over its own ranks.

[Note: a checkpoint of a job in parts]
A checkpoint is read by parameter name and flat range ([Note: chunks and resharding] in
checkpoint/format.py), so a job trained in parts writes the same format with two additions, and a
load at another split reads whatever names its own part owns, from whichever files hold them.  Each
part's parameters go under the job's names (not the part's own module keys), and its buckets are
numbered after the earlier parts' in one list, each bucket recording ``rank_base``: the job rank of
the part's first rank, whose chunk ``c`` is in ``rank_file(rank_base + c)``.  Every rank writes its
own file, named by its job rank; each part's first rank writes that part's frozen parameters and
buffers to a file of the part's own (``extra_files`` lists them); job rank 0 gathers the parts'
entries into one manifest and publishes it, after every rank of the job wrote, as any save does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch

from ..sharding.layout import BucketLayout, FlatLayout
from .format import EXTRA_FILE
from .interface import ModuleStateful, ShardedStateful


def extra_file(part: int) -> str:
    """The file of one part's frozen parameters and buffers (part 0: the one a single engine writes)."""
    return EXTRA_FILE if part == 0 else f"model_extra.part{part:03d}.safetensors"


class RenamedShards:
    """Shards whose buckets a checkpoint sees renamed and renumbered (``named``: each bucket as saved,
    with the engine's own bucket it stands for); everything else is the inner shards'."""

    def __init__(self, inner: ShardedStateful, named: Sequence[tuple[BucketLayout, BucketLayout]]) -> None:
        self.inner = inner
        self._local: dict[int, BucketLayout] = {saved.index: own for saved, own in named}
        self._layout = FlatLayout(tuple(saved for saved, _ in named), inner.layout.world_size)

    @property
    def layout(self) -> FlatLayout:
        return self._layout

    @property
    def rank(self) -> int:
        return self.inner.rank

    def rank_of(self, bucket: BucketLayout) -> int:
        return self.inner.rank_of(self._local[bucket.index])

    def chunk_ranks(self, bucket: BucketLayout) -> tuple[int, int]:
        return self.inner.chunk_ranks(self._local[bucket.index])

    @property
    def writes_chunks(self) -> bool:
        return self.inner.writes_chunks

    @property
    def saved_dtype(self) -> torch.dtype:
        return self.inner.saved_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.inner.compute_dtype

    def chunk_layout(self) -> list[tuple[int, int]]:
        return self.inner.chunk_layout()

    def read_bucket(self, bucket: BucketLayout, copy: bool = True) -> tuple[
            torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return self.inner.read_bucket(self._local[bucket.index], copy)

    def write_bucket(self, bucket: BucketLayout, values: torch.Tensor, state: Optional[dict[str, torch.Tensor]],
                     scalars: dict[str, torch.Tensor]) -> None:
        self.inner.write_bucket(self._local[bucket.index], values, state, scalars)

    def publish(self) -> None:
        self.inner.publish()

    def spread_state(self) -> None:
        self.inner.spread_state()


class JobNamedShards(RenamedShards):
    """A part's shards under the job's parameter names, its buckets numbered from ``bucket_base``."""

    def __init__(self, inner: ShardedStateful, rename: Callable[[str], str], bucket_base: int) -> None:
        named = []
        for bucket in inner.layout.buckets:
            slots = tuple(dataclasses.replace(s, name=rename(s.name)) for s in bucket.slots)
            named.append((dataclasses.replace(bucket, index=bucket.index + bucket_base, slots=slots), bucket))
        super().__init__(inner, named)


class JobNamedModule:
    """A part's module state under the job's names (``rename``: a module key to the job's name)."""

    def __init__(self, inner: ModuleStateful, rename: Callable[[str], str]) -> None:
        self.inner = inner
        self.rename = rename

    def describe(self) -> dict[str, Any]:
        model = self.inner.describe()
        renamed = {**model, "state_dict_keys": [self.rename(k) for k in model["state_dict_keys"]],
                   "trainable_of": {self.rename(k): self.rename(v) for k, v in model["trainable_of"].items()},
                   "buffer_names": [self.rename(k) for k in model.get("buffer_names", [])]}
        if "frozen_tied_to" in model:
            renamed["frozen_tied_to"] = {self.rename(k): self.rename(v) for k, v in model["frozen_tied_to"].items()}
        return renamed

    def extra_tensors(self, trainable_keys: set[str], keep: bool = True,
                      exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
        local = {k for k in self.inner.describe()["state_dict_keys"] if self.rename(k) in trainable_keys}
        return {self.rename(k): v for k, v in self.inner.extra_tensors(local, keep, exclude_frozen).items()}

    def load_extra(self, values: dict[str, torch.Tensor]) -> None:
        local = {self.rename(k): k for k in self.inner.describe()["state_dict_keys"]}
        self.inner.load_extra({local[k]: v for k, v in values.items() if k in local})


def with_every_experts_entries(fragments: list[Optional[dict[str, Any]]]) -> dict[str, Any]:
    """Rank 0's manifest with the buckets and model keys of the other expert-parallel ranks' experts
    (``fragments``: the manifests of the ranks holding their experts' first chunks, rank 0's first;
    see [Note: experts in a checkpoint] in experts/checkpoint.py)."""
    given = [f for f in fragments if f is not None]
    merged = dict(given[0])
    buckets = {int(b["index"]): b for f in given for b in f["buckets"]}
    merged["buckets"] = [buckets[i] for i in sorted(buckets)]
    keys = list(dict.fromkeys(k for f in given for k in f["model"]["state_dict_keys"]))
    merged["model"] = {**given[0]["model"], "state_dict_keys": keys,
                       "trainable_of": {k: v for f in given for k, v in f["model"]["trainable_of"].items()},
                       "buffer_names": list(dict.fromkeys(k for f in given for k in f["model"].get("buffer_names", [])))}
    return merged


def merged_manifest(fragments: list[Optional[dict[str, Any]]], model_class: str) -> dict[str, Any]:
    """One manifest out of each part's (in part order; None from ranks that lead no part): part 0's
    entries, every part's buckets and model keys, and every part's file of frozen parameters and buffers."""
    given = [f for f in fragments if f is not None]
    merged = dict(given[0])
    merged["buckets"] = [b for f in given for b in f["buckets"]]
    merged["model"] = {**given[0]["model"], "class": model_class, "hf_config": None, "peft_config": None,
                       "state_dict_keys": [k for f in given for k in f["model"]["state_dict_keys"]],
                       "trainable_of": {k: v for f in given for k, v in f["model"]["trainable_of"].items()},
                       "buffer_names": [k for f in given for k in f["model"].get("buffer_names", [])]}
    merged["extra_files"] = [extra_file(part) for part in range(len(given))]
    merged["parts"] = len(given)
    return merged
