"""Saving a checkpoint: every rank writes what it owns; rank 0 writes the manifest and flips ``latest``.

[Note: a save that is interrupted loses nothing]
All files go first into ``<save_dir>/.<tag>.incomplete/``.  Only when every rank has written and
checksummed its file does rank 0 write the manifest, move the directory to ``<save_dir>/<tag>`` and
then replace ``latest`` atomically.  A process killed at any point leaves the previous checkpoint and
``latest`` exactly as they were; the next save of the same tag clears the leftover directory.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch

from ..distributed.collectives import Collectives
from ..version import __version__
from .client_state import CLIENT_STATE_FILE, encode
from .format import (replaced_dir, EXTRA_FILE, FORMAT_NAME, FORMAT_VERSION, LATEST, MANIFEST, CheckpointError, rank_file,
                     FileWriting, SafetensorsWriter, write_json_atomic, write_text_atomic)
from .interface import CheckpointParts
from .job import extra_file, merged_manifest, with_every_experts_entries
from .pacing import StepPacing

#: room reserved for a rank file's header (see [Note: the header goes last] in checkpoint/format.py):
#: ~400 tensors' entries
_HEADER_ROOM = 1 << 16


def barrier(parts: CheckpointParts, label: str) -> None:
    parts.comm.all_reduce_scalar(0.0, label)


def _json_or_error(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{what} cannot be saved: it is not JSON-serializable ({err})") from None
    return value


class StagingBuffers:
    """Host copies of a rank's checkpoint tensors for asynchronous saves, kept from one save to the next.

    An asynchronous save copies the rank's whole state before training goes on; copied into fresh
    memory, every page of it is first touched then, most of a synchronous save's time on a machine where
    a first touch is slow (benchmarks/RESULTS.md, section "Asynchronous checkpoint saves", paragraph
    "Staging buffers kept between saves"); copied into the previous save's buffers, only the copy is
    paid.  At most one asynchronous save is in flight, and the next save waits for it, so the buffers
    are free again when the next capture reuses them.  They cost host memory equal
    to the rank's checkpoint from the first asynchronous save on (``release()`` gives it back), as
    DeepSpeed's decoupled writer keeps its buffers.

    [Note: staging a GPU's state]
    A tensor on a GPU is copied straight into its staging buffer, which is page-locked, without waiting
    (``non_blocking``), on a side stream that first waits for everything the training stream has queued
    (the state as of the save); the copies are waited for once, when all are queued, before anything
    reads the buffers.  A pageable copy would wait for the GPU at every tensor, and ``.to("cpu")``
    followed by a copy into the buffer would move every byte twice.  Host tensors are copied as they
    are.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Copy ``tensor`` into its buffer; from a GPU without waiting for the copy (see :meth:`stage`)."""
        held = self._buffers.get(name)
        pinned = tensor.is_cuda
        if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype or held.is_pinned() != pinned:
            held = self._buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
        return held.copy_(tensor, non_blocking=pinned)

    def release(self) -> None:
        self._buffers.clear()

    def stage(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Copy every tensor of ``tensors`` into these buffers (the copies, in order, every one landed)."""
        copied = []
        side: dict[torch.device, Any] = {}  # per GPU, the stream the copies run on
        for name, tensor in tensors:
            if not tensor.is_cuda:
                copied.append((name, self.copy(name, tensor)))
                continue
            stream = side.get(tensor.device)
            if stream is None:
                stream = side[tensor.device] = torch.cuda.Stream(tensor.device)
                stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the state as of the save
            tensor.record_stream(stream)  # a temporary (a concatenation) stays allocated until copied
            with torch.cuda.stream(stream):
                copied.append((name, self.copy(name, tensor)))
        for stream in side.values():
            stream.synchronize()
        return copied


def rank_tensors(parts: CheckpointParts, on_host: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """What this rank writes: its RNG state, copied now (every forward with dropout changes it), then,
    one bucket at a time as the result is iterated, its chunk (fp32 masters when there are any), its
    optimizer state (read back from host memory or NVMe where offloaded) and scalar state: the
    engine's own tensors where they are resident, which only the next optimizer step changes.
    ``on_host=False``: where they are (staging buffers copy them to the host: [Note: staging a GPU's
    state])."""
    rng = [(name, tensor.clone()) for name, tensor in parts.rng.state_dict().items()]
    return itertools.chain(rng, _bucket_tensors(parts, on_host))


def _bucket_tensors(parts: CheckpointParts, on_host: bool) -> Iterator[tuple[str, torch.Tensor]]:
    shards = parts.shards

    def placed(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("cpu") if on_host else tensor

    for bucket, (_, chunks) in zip(shards.layout.buckets, shards.chunk_layout()):
        if shards.rank_of(bucket) >= chunks or not shards.writes_chunks:
            continue  # stage 0: every rank holds the same bucket, rank 0 writes it; MiCS: the first group
        values, state, scalars = shards.read_bucket(bucket, copy=False)
        yield f"param.b{bucket.index}", placed(values)
        for key, value in scalars.items():
            yield f"optim_scalar.{key}.b{bucket.index}", placed(value)
        for key, value in state.items():
            yield f"optim.{key}.b{bucket.index}", placed(value).reshape(-1)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _manifest(parts: CheckpointParts, tag: str, client_state: Any, files: dict[str, Any],
              model: dict[str, Any]) -> dict[str, Any]:
    shards = parts.shards
    buckets = []
    for bucket, (chunk_numel, chunks) in zip(shards.layout.buckets, shards.chunk_layout()):
        base, stride = shards.chunk_ranks(bucket)
        base += parts.job.rank_base if parts.job is not None else 0
        buckets.append({
            "index": bucket.index, "group": bucket.group_index, "numel": bucket.numel,
            "padded_numel": bucket.padded_numel, "chunk_numel": chunk_numel, "num_chunks": chunks,
            "params": [{"name": s.name, "offset": s.offset, "numel": s.numel, "shape": list(s.shape)}
                       for s in bucket.slots],
            **({"rank_base": base} if parts.job is not None or base else {}),
            **({"rank_stride": stride} if stride != 1 else {}),
        })
    scheduler = parts.lr_scheduler.state_dict() if parts.lr_scheduler is not None else None
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "zeroshard_version": __version__,
        "tag": tag, "world_size": parts.world.world_size, "stage": parts.stage,
        "dtype": _dtype_name(shards.saved_dtype),  # the saved chunks: fp32 masters under mixed precision
        "compute_dtype": _dtype_name(shards.compute_dtype),
        "buckets": buckets,
        "optimizer": {"class": parts.optimizer.class_name,
                      "param_groups": _json_or_error(parts.optimizer.state_dict(), "the optimizer's hyperparameters")},
        "lr_scheduler": _json_or_error(scheduler, "the LR scheduler's state"),
        "engine": {**parts.counters.state_dict(), "loss_scaler": parts.loss_scaler.state_dict()},
        "loader": parts.loader.state_dict() if parts.loader is not None else None,
        # JSON, its tensors referenced: [Note: client state holds tensors, never pickles] in checkpoint/client_state.py
        "client_state": client_state,
        "model": {**model, "hf_config": _json_or_error(model["hf_config"], "the model's config"),
                  "peft_config": _json_or_error(model.get("peft_config"), "the peft adapter's config")},
        "files": files,
    }


@dataclass
class SaveRequest:
    """One checkpoint as it was at the instant of the save: what every rank writes and where.

    Captured on the training thread (:func:`capture`); written by :func:`write`, on the same thread
    (a synchronous save, reading the rank's buckets one at a time as it writes) or on a background
    thread (``async_save``, see [Note: asynchronous saves] in checkpoint/background.py): then
    ``stage_into`` holds the buffers the background thread first copies the rank's tensors into, unless
    :func:`capture` copied them already.
    """

    root: Path
    tag: str
    rank: int
    leader: bool  # who publishes (per node when node-local)
    node_local: bool
    save_latest: bool
    tensors: Iterable[tuple[str, torch.Tensor]]
    extra: dict[str, torch.Tensor]
    manifest: Optional[dict[str, Any]]  # rank 0: everything but the file list
    writing: FileWriting = FileWriting()
    stage_into: Optional[StagingBuffers] = None
    #: the file this rank writes the frozen parameters and buffers into (None: it writes none)
    extra_file: Optional[str] = None
    #: the client state's tensors, which the leader writes into CLIENT_STATE_FILE (host copies)
    client_tensors: Optional[dict[str, torch.Tensor]] = None

    @property
    def staging(self) -> Path:
        return self.root / f".{self.tag}.incomplete"

    @property
    def final(self) -> Path:
        return self.root / self.tag

    def stage(self) -> None:
        """Copy the rank's tensors into ``stage_into`` (on the background thread, before writing)."""
        if self.stage_into is not None:
            self.tensors, self.stage_into = self.stage_into.stage(self.tensors), None


def capture(parts: CheckpointParts, save_dir: str | Path, tag: str, client_state: Any = None,
            save_latest: bool = True, node_local: bool = False, exclude_frozen: bool = False,
            buffers: Optional[StagingBuffers] = None, writing: FileWriting = FileWriting(),
            copy_later: bool = False) -> SaveRequest:
    """Prepare a save of ``parts`` (every rank calls it): the leader clears the staging directory, stage
    3 gathers the frozen parameters, rank 0 takes the manifest's values, the RNG state is copied.
    With ``buffers`` the rank's tensors are copied into them, now or, with ``copy_later``, by
    :meth:`SaveRequest.stage` before anything changes them; otherwise they are read bucket by bucket
    while :func:`write` writes them."""
    root = Path(save_dir)
    rank = parts.world.rank
    leader = parts.world.local_rank == 0 if node_local else rank == 0
    staging = root / f".{tag}.incomplete"
    if leader:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    barrier(parts, "checkpoint_start")
    parts.shards.spread_state()  # every rank, before any bucket is read
    model = parts.module.describe()
    job = parts.job
    keeps_extra = leader if job is None else job.leader
    # every rank: stage 3 gathers its frozen buckets; the leader (of each part) keeps them (copies)
    extra = parts.module.extra_tensors(set(model["trainable_of"]), keep=keeps_extra, exclude_frozen=exclude_frozen)
    manifest = None
    # every rank: a client state that cannot be saved is refused on every rank alike, and each leader
    # writes the tensors into its directory (node-local saves: one per node)
    client_document, client_tensors = encode(client_state)
    experts = parts.experts
    if rank == 0 or (job is not None and job.leader) or (experts is not None and experts.leads):
        # a JSON round trip: the values as they are now
        manifest = json.loads(json.dumps(_manifest(parts, tag, client_document, {}, model)))
    if job is not None:  # see [Note: a checkpoint of a job in parts] in checkpoint/job.py
        fragments = parts.comm.all_gather_json(manifest if job.leader else None, "checkpoint_parts")
        manifest = merged_manifest(fragments, model["class"]) if rank == 0 else None
    if experts is not None:  # see [Note: experts in a checkpoint] in experts/checkpoint.py
        fragments = parts.comm.all_gather_json(manifest if experts.leads else None, "checkpoint_experts")
        manifest = with_every_experts_entries(fragments) if rank == 0 else None
    if manifest is not None and node_local:
        manifest["storage"] = {"node_local": True,
                               "ranks_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", parts.world.world_size))}
    request = SaveRequest(root, tag, rank, leader, node_local, save_latest, rank_tensors(parts, buffers is None),
                          extra, manifest, writing, stage_into=buffers,
                          extra_file=(extra_file(job.part) if job is not None else EXTRA_FILE) if keeps_extra else None,
                          client_tensors=client_tensors if leader and client_tensors else None)
    if not copy_later:
        request.stage()
    return request


def _write_file(path: Path, tensors: Iterable[tuple[str, torch.Tensor]], writing: FileWriting,
                pacing: Optional[StepPacing]) -> dict[str, Any]:
    writer = SafetensorsWriter(path, header_room=_HEADER_ROOM, writing=writing, checksum=True,
                               pace=pacing.take if pacing is not None else None)
    try:
        for name, tensor in tensors:
            writer.add(name, tensor)
        size = writer.finish()
    except BaseException:
        writer.abort()
        raise
    return {"bytes": size, **writer.checksum}


def _describe(err: Exception, where: Path) -> str:
    if isinstance(err, OSError):
        return f"{err.filename or where}: {err.strerror or err}"
    return f"{type(err).__name__}: {err}"


def _nbytes(tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    return sum(tensor.numel() * tensor.element_size() for _, tensor in tensors)


def write(request: SaveRequest, comm: Collectives, copy_failed: Optional[Exception] = None,
          pacing: Optional[StepPacing] = None) -> Path:
    """Write ``request``'s files, then publish the checkpoint (every rank calls it, over ``comm``).

    Every rank reports its files, or what went wrong, to every other; the checkpoint is published
    only if every rank wrote its part, and every rank raises otherwise (the error names the rank and the
    file).  ``copy_failed``: the copy of this rank's state into its staging buffers failed, so it writes
    nothing and reports that (the other ranks are in the same collectives and must hear of it).
    ``pacing``: the writing of an asynchronous save spread over optimizer steps (its tensors are staged
    copies, see [Note: a save spread over steps] in checkpoint/pacing.py).  Returns the published
    directory.
    """
    staging = request.staging
    files: dict[str, Any] = {}
    problem = None if copy_failed is None else f"its state could not be copied ({_describe(copy_failed, staging)})"
    extra = list(request.extra.items()) if request.extra_file is not None else []
    try:
        if problem is None:
            if pacing is not None:
                assert isinstance(request.tensors, list), "a paced save writes staged copies"
                pacing.begin(_nbytes(request.tensors) + _nbytes(extra))
            files[rank_file(request.rank)] = _write_file(staging / rank_file(request.rank), request.tensors,
                                                         request.writing, pacing)
            if extra:
                name = request.extra_file
                assert name is not None
                files[name] = _write_file(staging / name, extra, request.writing, pacing)
            if request.client_tensors:
                files[CLIENT_STATE_FILE] = _write_file(staging / CLIENT_STATE_FILE, request.client_tensors.items(),
                                                       request.writing, None)
    except Exception as err:  # noqa: BLE001 - every rank must hear of it, or the others wait forever
        problem = _describe(err, staging)
    reports = comm.all_gather_json({"files": files, "problem": problem}, "checkpoint_files")
    _raise_if_any(request, [r["problem"] for r in reports], "could not write its files")
    files = _all_files([r["files"] for r in reports])  # every rank: a problem raises everywhere
    manifest = None
    if request.rank == 0:
        assert request.manifest is not None
        manifest = {**request.manifest, "files": files}
    if request.node_local:  # every node publishes its own copy of the manifest
        manifest = comm.broadcast_json(manifest, 0, "checkpoint_manifest")
    problem = None
    if manifest is not None and request.leader:
        try:
            write_json_atomic(staging / MANIFEST, manifest)
            _publish(request.root, staging, request.tag, request.save_latest)
        except OSError as err:
            problem = _describe(err, staging)
    _raise_if_any(request, comm.all_gather_json(problem, "checkpoint_done"), "could not publish it")
    return request.final


def _raise_if_any(request: SaveRequest, problems: list[Optional[str]], what: str) -> None:
    failed = [f"rank {r} {what} ({p})" for r, p in enumerate(problems) if p]
    if failed:
        raise CheckpointError(f"checkpoint {request.tag!r} under {request.root} was not published: "
                              + "; ".join(failed) + "; the previous checkpoint is untouched")


def _all_files(reported: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's files, for the manifest.

    [Note: node-local checkpoints]
    With ``checkpoint.use_node_local_storage`` no directory is shared between nodes: every rank
    writes its file into its own node's ``save_dir``, each node's local rank 0 writes the frozen
    parameters and buffers there too, and the file sizes and checksums travel by collective (as they
    always do).  Rank 0 builds the manifest, which lists every rank's file, and each node's local rank
    0 writes the same bytes and publishes the directory and ``latest`` on its node.  A node then holds
    its own ranks' files: such a checkpoint loads with the same world size, ranks per node, stage and
    buckets (each rank reads only its own file); to reshard it, copy every node's files into one
    directory first.
    """
    files: dict[str, Any] = {}
    for name, what in ((EXTRA_FILE, "frozen parameters or buffers"), (CLIENT_STATE_FILE, "client state tensors")):
        copies = {json.dumps(theirs[name], sort_keys=True) for theirs in reported if name in theirs}
        if len(copies) > 1:
            raise CheckpointError(f"{name} differs between nodes ({what} that are not the same on every node); "
                                  f"this checkpoint was not published")
    for theirs in reported:
        files.update({name: meta for name, meta in theirs.items() if name not in files})
    return files


def save_checkpoint(parts: CheckpointParts, save_dir: str | Path, tag: str, client_state: Any = None,
                    save_latest: bool = True, node_local: bool = False, exclude_frozen: bool = False,
                    writing: FileWriting = FileWriting()) -> Path:
    """Write a checkpoint of ``parts`` under ``save_dir/tag`` and publish it; every rank must call it.

    The rank's state is read one bucket at a time as it is written, so a save holds one bucket's
    copies at a time, not the rank's whole state.  ``node_local`` (``checkpoint.use_node_local_storage``):
    ``save_dir`` is a directory of each node's own; see [Note: node-local checkpoints].
    """
    request = capture(parts, save_dir, tag, client_state, save_latest, node_local, exclude_frozen, writing=writing)
    return write(request, parts.comm)


def _publish(root: Path, staging: Path, tag: str, save_latest: bool) -> None:
    """Move the complete ``staging`` directory to ``root/tag`` and name it in ``latest``."""
    final = root / tag
    old = replaced_dir(root, tag)
    if final.exists():  # re-saving a tag: the old one stays readable until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    staging.rename(final)
    if save_latest:
        write_text_atomic(root / LATEST, tag)
    shutil.rmtree(old, ignore_errors=True)
