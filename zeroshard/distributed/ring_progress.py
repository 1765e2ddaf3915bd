"""A thread of its own that carries gloo's rings forward while the training thread computes.

[Note: rings progress on their own thread]
A ring (distributed/ring.py) posts its first messages when it is launched; everything after that
(waiting for a piece, adding it, sending it on, posting the next receive) is work someone must do
while the ring is in flight.  gloo moves a message's payload only once its receiver has posted the
receive, so a reduce-scatter carried forward only by ``wait()`` on the training thread would move its
first two pieces and then stand still until backward came to wait for it: the collective meant to
overlap the next bucket's backward would run after it instead, and stage 2's backward would take
markedly longer than DDP's, whose all-reduces run on gloo's own threads (measured in
benchmarks/RESULTS.md, section "One bucket's collectives", paragraph "zeroshard's rings on a thread of
their own").

So each launched ring is handed to a daemon thread of its process group, which drives the group's
rings to completion in the order they were launched (every rank launches a group's rings in the same
order, so no rank waits for a ring its neighbour has not reached); ``wait()`` on the training thread
only waits for the thread to finish that ring.  One thread per group, not per process: rings of
different groups are launched from different threads (an asynchronous save gathers its file list on a
group of its own while training launches gathers), so their order differs from rank to rank, and one
queue for all of them could deadlock two ranks, each waiting on the ring the other queued behind it.
The thread holds the GIL only between torch calls (a wait for a message and an addition both release
it), so it runs while autograd computes.  Which thread carries a ring changes nothing in its
arithmetic: the same additions in the same order, bitwise the same results.  An error in a ring (a
timeout, a lost peer) is raised by that ring's ``wait()``, on the training thread.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
from typing import Optional, Protocol

import torch

from .world import release_at_exit

#: how long, at exit, a progress thread is given to finish the rings handed to it
_EXIT_JOIN_S = 30.0


class Ring(Protocol):
    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool: ...


class DrivenRing:
    """A ring being carried forward by the progress thread; ``wait()`` until it is done."""

    def __init__(self, ring: Ring, timeout: Optional[datetime.timedelta]) -> None:
        self._ring: Optional[Ring] = ring
        self._timeout = timeout
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def run(self) -> None:
        """On the progress thread: every message of the ring, each wait bounded by the timeout."""
        try:
            assert self._ring is not None
            with torch.no_grad():  # grad mode is per thread; a ring only moves and adds buffers
                self._ring.wait(self._timeout)
        except BaseException as err:  # handed to the training thread, raised by wait()
            self._error = err
        finally:
            self._ring = None  # its buffers belong to the caller again
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        """Block until the ring is done.  Its own messages' waits carry the timeout (given when it was
        launched), so this returns or raises once they do; ``timeout`` is accepted for the interface."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True


class _GroupThread:
    """One group's progress thread and the queue of its launched rings (the group is kept alive here,
    so that its id is not reused while the thread serves it)."""

    def __init__(self, group: object) -> None:
        self.group = group
        self.queue: "queue.SimpleQueue[Optional[DrivenRing]]" = queue.SimpleQueue()  # None: stop
        self.thread = threading.Thread(target=RingProgress._serve, args=(self.queue,),
                                       name="zeroshard-rings", daemon=True)
        self.thread.start()


class RingProgress:
    """The process's progress threads, one per process group, each started on the group's first ring
    (and again in a forked child)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: dict[int, _GroupThread] = {}
        self._pid = 0
        self._released_at_exit = False

    def drive(self, ring: Ring, timeout: Optional[datetime.timedelta], group: object) -> DrivenRing:
        """Hand a launched ring to ``group``'s thread; it is completed after every ring of that group
        handed over before it."""
        driven = DrivenRing(ring, timeout)
        with self._lock:
            if self._pid != os.getpid():  # a forked child inherits neither threads nor rings
                self._threads, self._pid = {}, os.getpid()
            served = self._threads.get(id(group))
            if served is None or not served.thread.is_alive():
                served = self._threads[id(group)] = _GroupThread(group)
                if not self._released_at_exit:
                    release_at_exit(self.release, last=True)  # after the engines' and saves' rings
                    self._released_at_exit = True
            served.queue.put(driven)
        return driven

    def release(self) -> None:
        """Stop every progress thread once the rings handed to it are done, and let go of their groups
        (see [Note: a clean exit] in distributed/world.py: a group still held at interpreter shutdown
        keeps gloo's threads running into it).  A thread still busy after ``_EXIT_JOIN_S`` (a ring waiting
        on a rank that is gone) is left to the process's end."""
        with self._lock:
            served, self._threads = list(self._threads.values()), {}
        for each in served:
            each.queue.put(None)
        for each in served:
            each.thread.join(_EXIT_JOIN_S)

    @staticmethod
    def _serve(rings: "queue.SimpleQueue[Optional[DrivenRing]]") -> None:
        while (ring := rings.get()) is not None:
            ring.run()


#: the one per process: each group's rings are completed in the order this process launched them
RING_PROGRESS = RingProgress()
