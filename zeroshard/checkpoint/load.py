"""Loading a checkpoint into an engine of any world size and any stage: no conversion step.

Each rank reads, from whatever files hold them, exactly the elements of the chunks it owns now
(its parameters and their optimizer moments), then the stage makes full parameters current where it
keeps them whole.  No rank reads more than its own share, except at stage 0, where every rank owns
everything.

[Note: a load is all or nothing]
A load changes nothing until the whole checkpoint has been validated on every rank: the manifest's
schema, every listed file's size and checksum (and that every rank file the chunks need is
listed), and that it fits the model.  The ranks then agree: if any rank found a problem, every rank
raises (the failing one with the file and the reason, the others naming the failing ranks), and
if the ranks opened different checkpoints (different ``latest``, different directories), every rank
raises a DivergenceError.  Only then does any part's ``load_state_dict`` run.

[Note: a directory with no latest checkpoint]
Asked for the latest checkpoint (no tag) of a directory that has no ``latest`` file, a load loads
nothing and returns ``(None, None)`` with a warning, as DeepSpeed's does: a training script calls
``load_checkpoint(save_dir)`` on every start, the first one included, when nothing has been saved
yet.  The ranks agree on it as on a problem, in the same all-reduce (a rank without ``latest`` adds
``world + 1``, one with a problem 1, so the sum tells both counts apart): every rank loads nothing, or
every rank raises naming how many ranks lacked the file (a node-local save one node cannot see).
A named tag that does not exist, and a ``latest`` naming one, stay errors.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ..logging import logger
from ..sharding.layout import BucketLayout
from .deepspeed_format import DeepSpeedReader, deepspeed_directory
from .deepspeed_format.universal_read import LATEST_UNIVERSAL
from .format import LATEST, MANIFEST, CheckpointError, published_dir, rank_file, resolve_tag  # resolve_tag: public
from .client_state import CLIENT_STATE_FILE, decode
from .interface import CheckpointParts
from .reader import CheckpointReader, chunk_saver
from .tensor_parts import TENSOR_SPLIT_FILE, TensorPartsReader, is_tensor_parallel_job

#: the manifest's required entries and their JSON types
_SCHEMA: dict[str, type] = {
    "world_size": int, "stage": int, "buckets": list, "files": dict, "engine": dict, "optimizer": dict,
    "model": dict, "dtype": str}
_COUNTERS = ("global_steps", "micro_steps", "global_samples")
_JSON_KIND = {int: "an integer", list: "a list", dict: "an object", str: "a string"}


def _check_model(parts: CheckpointParts, reader: Reader, strict: bool) -> None:
    ours = {s.name: tuple(s.shape) for b in parts.shards.layout.buckets for s in b.slots}
    theirs = {name: reader.shape(name) for name in reader.param_names()}
    wrong = [f"{n} (checkpoint {theirs[n]}, model {ours[n]})" for n in ours if n in theirs and theirs[n] != ours[n]]
    missing = [n for n in ours if n not in theirs]
    elsewhere = (parts.job.job_param_names if parts.job is not None else frozenset()) | (  # other parts' names
        parts.experts.names if parts.experts is not None else frozenset())  # other ranks' experts
    unexpected = [n for n in theirs if n not in ours and n not in elsewhere]
    problems = []
    if wrong:
        problems.append("shape mismatch: " + ", ".join(wrong))
    if strict and missing:
        problems.append("missing from the checkpoint: " + ", ".join(missing))
    if strict and unexpected:
        problems.append("not in the model: " + ", ".join(unexpected))
    if problems:
        raise CheckpointError(f"{reader.directory}: does not fit this model; " + "; ".join(problems))


def check_manifest(directory: Path, data: Any) -> None:
    """The manifest has every entry a load reads, of the right type, and lists every rank file."""
    path = directory / MANIFEST
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: the manifest is a {type(data).__name__}, not an object")
    for key, kind in _SCHEMA.items():
        if not isinstance(data.get(key), kind):
            raise CheckpointError(f"{path}: entry {key!r} is missing or not {_JSON_KIND[kind]}")
    for key in _COUNTERS:
        if not isinstance(data["engine"].get(key), int):
            raise CheckpointError(f"{path}: entry engine.{key} is missing or not an integer")
    if not isinstance(data["optimizer"].get("param_groups"), list):
        raise CheckpointError(f"{path}: entry optimizer.param_groups is missing or not a list")
    for bucket in data["buckets"]:
        if not isinstance(bucket, dict) or not all(isinstance(bucket.get(k), int)
                                                   for k in ("index", "chunk_numel", "num_chunks")):
            raise CheckpointError(f"{path}: a bucket entry lacks index/chunk_numel/num_chunks")
    needed = {0} | {chunk_saver(b, c) for b in data["buckets"] for c in range(b["num_chunks"])}
    unlisted = [rank_file(r) for r in sorted(needed) if rank_file(r) not in data["files"]]
    if unlisted:
        raise CheckpointError(f"{path}: does not list {', '.join(unlisted)} (its size and checksum are unknown, "
                              f"so it cannot be verified)")


def _check_node_local(parts: CheckpointParts, directory: Path, data: dict[str, Any]) -> None:
    """A node-local checkpoint loads only where each rank finds its own file, and nothing else is needed
    (see [Note: node-local checkpoints] in checkpoint/save.py)."""
    storage = data.get("storage") or {}
    if not storage.get("node_local"):
        return
    world = parts.world
    here = int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size))
    ours = [[chunk_numel, chunks] for chunk_numel, chunks in parts.shards.chunk_layout()]
    theirs = [[b["chunk_numel"], b["num_chunks"]] for b in data["buckets"]]
    differs = [what for what, same in (
        (f"world size {data['world_size']} (now {world.world_size})", data["world_size"] == world.world_size),
        (f"{storage.get('ranks_per_node')} ranks per node (now {here})", storage.get("ranks_per_node") == here),
        (f"ZeRO stage {data['stage']} (now {parts.stage})", data["stage"] == parts.stage),
        ("other buckets (reduce_bucket_size / stage-3 units)", theirs == ours)) if not same]
    if differs:
        raise CheckpointError(f"{directory / MANIFEST}: a node-local checkpoint (each node holds only its own ranks' "
                              f"files) saved with {', '.join(differs)}; load it with the same layout, or copy every "
                              f"node's files into one directory to reshard it")


def _agree(parts: CheckpointParts, problem: Optional[str], identity: str, no_latest: bool = False) -> bool:
    """Every rank validated the same checkpoint without a problem (False), or every rank found no
    ``latest`` to load (True), or every rank raises (see [Note: a directory with no latest checkpoint])."""
    n = parts.world.world_size if parts.world.is_distributed else 1
    missing_weight = n + 1
    mine = 1.0 if problem else float(missing_weight) if no_latest else 0.0
    total = round(parts.comm.all_reduce_scalar(mine, "checkpoint_validated")) if parts.world.is_distributed \
        else round(mine)
    lacking, failed = divmod(total, missing_weight)
    if problem:
        raise CheckpointError(problem)
    if failed:
        raise CheckpointError(f"the checkpoint failed validation on {failed} other rank(s) (their error names "
                              f"the file); nothing was loaded")
    if 0 < lacking < n:
        raise CheckpointError(f"{lacking} of {n} ranks find no 'latest' file in the load directory: every rank "
                              f"must see the same checkpoints (a node-local save is loaded on the same nodes); "
                              f"nothing was loaded")
    if lacking == n:
        return True
    parts.agree_on(identity)  # the same checkpoint on every rank, or a DivergenceError on every rank
    return False


def files_to_read(parts: CheckpointParts, reader: Reader) -> set[str]:
    """The files this rank's load reads, which are the ones it verifies: those holding its chunks (at
    any world size or bucket plan), the one its scalar optimizer state comes from, its own (for its RNG
    state) and the frozen parameters and buffers.  A rank never checksums files it does not read, so
    verification costs each rank about its own share of the checkpoint, not all of it."""
    known = set(reader.param_names())
    files = {reader.home_file(), rank_file(parts.world.rank), *reader.extra_files(), CLIENT_STATE_FILE}
    for bucket, (chunk_numel, _) in zip(parts.shards.layout.buckets, parts.shards.chunk_layout()):
        start = bucket.chunk_start(chunk_numel, parts.shards.rank_of(bucket))
        # the ranges _fill reads, walked without reading (the callback answers None: nothing copied)
        bucket.fill_chunk(start, torch.empty(chunk_numel, device="meta"), lambda slot, lo, hi: files.update(
            reader.files_holding(slot.name, lo, hi) | {reader.scalar_file(reader.bucket_of(slot.name))})
            if slot.name in known else None)
    return files & set(reader.data["files"])


def _saved_keys(reader: Reader, bucket: BucketLayout, keys: list[str], known: set[str]) -> list[str]:
    """The optimizer states saved for ``bucket``'s parameters: an optimizer whose parameter groups keep
    different states (Muon's momentum, AdamW's moments) saves each bucket's own."""
    names = [s.name for s in bucket.slots if s.name in known]
    return [k for k in keys if not names or any(reader.holds(n, f"optim.{k}") for n in names)]


def _fill(reader: Reader, bucket: BucketLayout, start: int, target: torch.Tensor, key: str,
          known: set[str]) -> None:
    """Copy into ``target`` (a chunk starting at ``start`` in ``bucket``) every parameter element it holds."""
    bucket.fill_chunk(start, target, lambda slot, lo, hi: reader.read(slot.name, key, lo, hi)
                      if slot.name in known else None)


#: what a load reads from: one checkpoint, a tensor-parallel job's parts joined, or one DeepSpeed wrote
Reader = Union[CheckpointReader, TensorPartsReader, DeepSpeedReader]


def _open_deepspeed(parts: CheckpointParts, directory: Path, strict: bool) -> tuple[Reader, str]:
    """A checkpoint DeepSpeed wrote, read whole and checked against ``parts`` (see [Note: a DeepSpeed
    checkpoint read whole] in checkpoint/deepspeed_format/reader.py)."""
    if parts.tensor_slice is not None and parts.tensor_slice[1] > 1:
        raise CheckpointError(f"{directory}: a DeepSpeed checkpoint into a tensor-parallel engine is not read yet")
    reader = DeepSpeedReader(directory)
    try:
        _check_model(parts, reader, strict)
    except BaseException:
        reader.close()
        raise
    return reader, reader.identity()


def _open_reader(parts: CheckpointParts, root: Path, tag: Optional[str], strict: bool) -> tuple[Reader, str]:
    """The checkpoint under ``root`` opened and checked against ``parts``, and its identity (what every
    rank must agree on); a tensor-parallel job's parts are joined at this rank's size."""
    deepspeed = None if is_tensor_parallel_job(root) else deepspeed_directory(root, tag)
    if deepspeed is not None:
        return _open_deepspeed(parts, deepspeed, strict)
    rank, size, dims = parts.tensor_slice or (0, 1, {})
    if is_tensor_parallel_job(root) or size > 1:  # parts joined, or a whole model split, at this size
        joined = TensorPartsReader(root, tag, rank, size, dims)  # every part verified as it opens
        try:
            _check_model(parts, joined, strict)
        except BaseException:
            joined.close()
            raise
        split = (root / TENSOR_SPLIT_FILE).read_bytes() if is_tensor_parallel_job(root) else b""
        return joined, hashlib.sha256(split + (joined.directory / MANIFEST).read_bytes()).hexdigest()
    directory = published_dir(root, resolve_tag(root, tag))
    raw = (directory / MANIFEST).read_bytes() if (directory / MANIFEST).is_file() else b""

    def validate(d: Path, data: Any) -> None:
        check_manifest(d, data)
        _check_node_local(parts, d, data)

    reader = CheckpointReader(directory, rank=parts.world.rank, validate=validate, verify=False)
    try:
        _check_model(parts, reader, strict)
        reader.manifest.verify_files(files_to_read(parts, reader))
    except BaseException:
        reader.close()
        raise
    return reader, hashlib.sha256(raw).hexdigest()


def open_checkpoint(parts: CheckpointParts, load_dir: str | Path, tag: Optional[str],
                    strict: bool) -> Optional[Reader]:
    """Resolve, read and validate the checkpoint on every rank (see [Note: a load is all or nothing]);
    None where no tag was given and no rank has a ``latest`` file ([Note: a directory with no latest
    checkpoint])."""
    reader: Optional[Reader] = None
    problem: Optional[str] = None
    identity = ""
    root = Path(load_dir)
    no_latest = tag is None and not is_tensor_parallel_job(root) and not (root / LATEST).is_file() \
        and not (root / LATEST_UNIVERSAL).is_file()  # a DeepSpeed universal folder's (deepspeed_format/)
    if not no_latest:
        try:
            reader, identity = _open_reader(parts, root, tag, strict)
        except CheckpointError as err:
            problem = str(err)
    try:
        nothing = _agree(parts, problem, identity, no_latest)
    except BaseException:
        if reader is not None:
            reader.close()
        raise
    if nothing:
        return None
    assert reader is not None  # _agree raised otherwise
    return reader


def load_checkpoint(parts: CheckpointParts, load_dir: str | Path, tag: Optional[str] = None,
                    load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                    restore_rng: bool = True) -> tuple[Optional[Path], Any]:
    """Load ``load_dir/tag`` (default: the tag named by ``latest``) into ``parts``; every rank calls it.

    Returns ``(path, client_state)`` as DeepSpeed does; ``(None, None)`` when no tag is given and the
    directory has no ``latest`` ([Note: a directory with no latest checkpoint]).
    """
    reader = open_checkpoint(parts, load_dir, tag, load_module_strict)
    if reader is None:
        if parts.world.rank == 0:
            logger.warning(f"load_checkpoint: no '{LATEST}' file in {load_dir}, so there is no latest checkpoint "
                           f"to load; nothing was loaded (pass tag= to load a particular one)")
        return None, None
    with reader:
        return _load(parts, reader, load_optimizer_states, load_lr_scheduler_states, load_module_only, restore_rng)


def _load(parts: CheckpointParts, reader: Reader, load_optimizer_states: bool,
          load_lr_scheduler_states: bool, load_module_only: bool, restore_rng: bool) -> tuple[Optional[Path], Any]:
    known = set(reader.param_names())
    with_optimizer = load_optimizer_states and not load_module_only
    keys = reader.optimizer_state_keys() if with_optimizer else []
    shards = parts.shards
    with torch.no_grad():
        for bucket in shards.layout.buckets:
            values, state, scalars = shards.read_bucket(bucket)
            start = bucket.chunk_start(values.numel(), parts.shards.rank_of(bucket))
            _fill(reader, bucket, start, values, "param", known)
            if keys:
                for key in _saved_keys(reader, bucket, keys, known):
                    buffer = state.get(key)
                    if buffer is None or buffer.numel() != values.numel():
                        buffer = torch.zeros_like(values)
                        state[key] = buffer
                    _fill(reader, bucket, start, buffer.view(-1), f"optim.{key}", known)
                first = next((s.name for s in bucket.slots if s.name in known), None)
                if first is not None:
                    scalars = {k: v.clone() for k, v in reader.scalar_state(reader.bucket_of(first)).items()}
            # writes the values (and the state) where they live, and publishes masters into the parameters
            shards.write_bucket(bucket, values, state if keys else None, scalars)
        parts.module.load_extra(reader.extra())
        shards.publish()
    manifest = reader.data
    if not load_module_only:
        _load_rest(parts, reader, manifest, with_optimizer, load_lr_scheduler_states, restore_rng)
    return reader.directory, decode(manifest.get("client_state"), reader.client_tensor)


def _load_rest(parts: CheckpointParts, reader: Reader, manifest: dict, with_optimizer: bool,
               with_scheduler: bool, restore_rng: bool) -> None:
    engine = manifest["engine"]
    parts.counters.load_state_dict(engine)
    # A dynamic loss scale carries over only from one dynamically scaled fp16 run into another.
    saved_scaler = engine.get("loss_scaler")
    if saved_scaler is not None and saved_scaler.get("dynamic") and parts.loss_scaler.state_dict().get("dynamic"):
        parts.loss_scaler.load_state_dict(saved_scaler)
    if with_optimizer:
        parts.optimizer.load_state_dict(manifest["optimizer"]["param_groups"])
    if with_scheduler and parts.lr_scheduler is not None and manifest.get("lr_scheduler") is not None:
        parts.lr_scheduler.load_state_dict(manifest["lr_scheduler"])
    if restore_rng and manifest["world_size"] == parts.world.world_size:
        rank = parts.world.rank
        parts.rng.load_state_dict({k: t for k in ("rng.torch", "rng.cuda")
                                   if (t := reader.rank_tensor(rank, k)) is not None})
    if parts.loader is not None and manifest.get("loader") is not None:
        parts.loader.load_state_dict(manifest["loader"])

