"""Asynchronous checkpoint saves: the state is copied, then written and published, on a background thread.

[Note: asynchronous saves]
``save_checkpoint(..., async_save=True)`` (or ``checkpoint.writer.decoupled``) splits a save in two.
On the training thread, every rank takes what training changes before its next optimizer step (its
RNG state; the leader's frozen parameters and buffers, which stage 3 gathers with collectives; rank
0's manifest values) and returns.  A background thread then copies the rank's chunks and optimizer
state into host staging buffers (:class:`~zeroshard.checkpoint.save.StagingBuffers`), exactly as a
synchronous save would read them, writes the files and publishes the checkpoint by the same rules as
a synchronous save ([Note: a save that is interrupted loses nothing] in checkpoint/save.py): staging
directory, checksums, manifest, atomic rename, ``latest`` last.  A crash at any instant therefore
leaves the last *published* checkpoint loadable; the one in flight is simply not there.

The copy runs while the next forward and backward do (they only read what it copies), and whatever
writes that state first waits for it (:func:`wait_for_copies`): the engine's optimizer step,
``load_checkpoint``, ``load_state_dict``, ``load_pretrained``, ``GatheredParameters(modifier_rank=...)``,
the next save and ``close()``.  As with torch.distributed.checkpoint's ``async_save``, a script that
writes parameters by hand between a save and the next step must call ``engine.wait_for_checkpoint()``
first.  Under NVMe offload the copy is taken on the training thread (the swap files are read by one
thread at a time).

The ranks agree on the outcome with collectives of their own, over a gloo group that only this
thread uses (created once, at the first asynchronous save, when every rank is in ``save_checkpoint``),
so they never interleave with the training collectives on the engine's groups, and their bytes are
not counted as ZeRO traffic.  At most one save is in flight: the next save, a load and
``engine.close()`` first wait for it (``engine.wait_for_checkpoint()`` does so explicitly), and raise
its error, on every rank, if it failed (a copy that failed is reported by the same collectives).  At
interpreter exit a pending save is finished before the process groups go.  The staging buffers cost
host memory equal to the rank's checkpoint bytes, kept for the next save until ``close()``.  With
``checkpoint.writer.spread_over_steps`` the writing is paced by the engine's optimizer steps
([Note: a save spread over steps] in checkpoint/pacing.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..distributed.collectives import Collectives
from ..distributed.world import World, new_side_group
from .format import CheckpointError
from .pacing import StepPacing
from .save import SaveRequest, StagingBuffers, write

logger = logging.getLogger(__name__)

#: the copies of asynchronous saves in this process, set once the state is copied (see the Note)
_COPIES: "weakref.WeakSet[threading.Event]" = weakref.WeakSet()


def wait_for_copies() -> None:
    """Block until every asynchronous save in flight has copied the state it saves; call it before
    writing parameters or optimizer state (see [Note: asynchronous saves])."""
    for copied in list(_COPIES):
        copied.wait()


def _lower_priority() -> None:
    """Give the writing thread the lowest CPU priority (Linux: a thread's nice value is its own).

    Writing a file costs CPU time too (copies into the page cache, the checksum); where training keeps
    every core busy, a writer at the same priority takes its share from the training step.  At nice 19
    it runs in the cycles training leaves: the save takes longer, the steps it overlaps barely change.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: the save still works, at normal priority
        pass


class BackgroundSaves:
    """The engine's asynchronous saves: at most one in flight (see the Note)."""

    def __init__(self, world: World) -> None:
        self._world = world
        self._comm: Optional[Collectives] = None
        self._thread: Optional[threading.Thread] = None
        self._request: Optional[SaveRequest] = None
        self._error: Optional[BaseException] = None
        self._pacing: Optional[StepPacing] = None
        self._copied: Optional[threading.Event] = None  # set once the save in flight has copied the state
        #: seconds the last background save took, from its submission to its publication
        self.last_save_s: Optional[float] = None
        #: the host copies each asynchronous save is captured into, reused by the next
        self.buffers = StagingBuffers()

    def copying(self) -> bool:
        """Whether the save in flight is still copying the state (stage 3 lends no chunk meanwhile)."""
        return self._copied is not None and not self._copied.is_set()

    def wait_for_copies(self) -> None:
        """Block until the save in flight has copied the state (before anything writes it)."""
        if self._copied is not None:
            self._copied.wait()

    @property
    def in_flight(self) -> bool:
        """Whether a save is still being written (without waiting for it)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending(self) -> Optional[Path]:
        """Where the save in flight will be published (None: nothing in flight)."""
        return self._request.final if self._thread is not None and self._request is not None else None

    def _collectives(self) -> Collectives:
        if self._comm is None:
            world = self._world
            if world.is_distributed:  # every rank is in save_checkpoint: creating the group is safe here
                world = dataclasses.replace(world, group=new_side_group(world, backend="gloo"),
                                            device=torch.device("cpu"), backend="gloo")
            self._comm = Collectives(world)  # a ledger of its own: a save's bytes are not ZeRO's traffic
        return self._comm

    def submit(self, request: SaveRequest, then: Optional[Callable[[], None]] = None,
               spread_over_steps: int = 1) -> None:
        """Copy (unless captured already), write and publish ``request`` in the background, then call
        ``then`` (pruning).  ``spread_over_steps`` N: write at most 1/N of the bytes per optimizer step
        (:meth:`stepped`), see [Note: a save spread over steps] in checkpoint/pacing.py."""
        if self._thread is not None:
            raise RuntimeError("an asynchronous save is already in flight; wait() for it first")
        comm = self._collectives()
        pacing = self._pacing = StepPacing(spread_over_steps)

        started = time.perf_counter()
        copied = self._copied = threading.Event()
        _COPIES.add(copied)

        def run() -> None:
            copy_failed: Optional[Exception] = None
            try:  # at normal priority: the next optimizer step waits for this copy
                request.stage()
            except Exception as err:  # noqa: BLE001 - reported to every rank by write()
                copy_failed = err
            finally:
                copied.set()
            _lower_priority()
            try:
                write(request, comm, copy_failed, pacing if pacing.paced else None)
                self.last_save_s = time.perf_counter() - started
                if then is not None:
                    then()
            except BaseException as err:  # noqa: BLE001 - handed to the training thread by wait()
                self._error = err

        self._request, self._error = request, None
        self._thread = threading.Thread(target=run, name=f"zeroshard-save-{request.tag}", daemon=True)
        self._thread.start()

    def stepped(self) -> None:
        """The engine took an optimizer step: a paced save may write its next share."""
        if self._pacing is not None:
            self._pacing.stepped()

    def wait(self) -> Optional[Path]:
        """Block until the save in flight is published; returns its directory (None: there was none).
        Raises :class:`CheckpointError` on every rank if it failed anywhere.  A paced save goes at full
        speed from here."""
        thread, request = self._thread, self._request
        if thread is None or request is None:
            return None
        if self._pacing is not None:
            self._pacing.lift()
        thread.join()
        self._pacing = None
        self._thread = self._request = None
        error, self._error = self._error, None
        if error is not None:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"the asynchronous save of checkpoint {request.tag!r} under {request.root} "
                                  f"failed: {error}; the previous checkpoint is untouched") from error
        return request.final

    def release(self) -> None:
        """At exit (before the process groups go): finish the save in flight, then drop the group."""
        try:
            self.wait()
        except CheckpointError as err:
            logger.error("%s", err)
        if self._comm is not None:
            self._comm.world = dataclasses.replace(self._comm.world, group=None)

    def close(self) -> None:
        """``engine.close()``: wait for the save in flight (raising its error), then destroy the group."""
        try:
            self.wait()
        finally:
            self.buffers.release()
            group = self._comm.world.group if self._comm is not None else None
            self._comm = None
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)
