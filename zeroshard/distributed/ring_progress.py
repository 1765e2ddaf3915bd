"""A thread of its own that carries gloo's rings forward while the training thread computes.

[Note: rings progress on their own thread]
A ring (ring.py) posts its first messages when it is launched; everything after that (waiting for a
piece, adding it, sending it on, posting the next receive) used to run in ``wait()``, on the training
thread.  gloo moves a message's payload only once its receiver has posted the receive, so a launched
reduce-scatter moved its first two pieces and then stood still until backward came to wait for it:
the collective that was meant to overlap the next bucket's backward ran after it instead.  Measured
at 91M fp32, world 2, DeepSpeed's defaults (eight 45 MiB buckets), beside DDP in one world (whose
all-reduces run on gloo's own threads): stage 2's backward took 4.11-4.18 s against DDP's 3.33-3.37;
driven from this thread, 3.51-3.59 s against 3.53-3.55, and the whole step went from 1.10-1.17x
DDP's to 1.02x (benchmarks/RESULTS.md, nineteenth session).

Here each launched ring is handed to one daemon thread per process, which drives the rings to
completion in the order they were launched (every rank launches them in the same order, so no rank
waits for a ring its neighbour has not reached); ``wait()`` on the training thread only waits for
the thread to finish that ring.  The thread holds the GIL only between torch calls (a wait for a
message and an addition both release it), so it runs while autograd computes.  A ring computes the
same additions in the same order as before: results are bitwise the same.  An error in a ring (a
timeout, a lost peer) is raised by that ring's ``wait()``, on the training thread.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
from typing import Optional, Protocol

import torch


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


class RingProgress:
    """The process's one progress thread, started on first use (and again in a forked child)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: "queue.SimpleQueue[DrivenRing]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._pid = 0

    def drive(self, ring: Ring, timeout: Optional[datetime.timedelta]) -> DrivenRing:
        """Hand a launched ring to the thread; it is completed after every ring handed over before it."""
        driven = DrivenRing(ring, timeout)
        with self._lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._queue = queue.SimpleQueue()  # a forked child inherits neither thread nor rings
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._serve, args=(self._queue,),
                                                name="zeroshard-rings", daemon=True)
                self._thread.start()
            self._queue.put(driven)
        return driven

    @staticmethod
    def _serve(rings: "queue.SimpleQueue[DrivenRing]") -> None:
        while True:
            rings.get().run()


#: the one per process: rings of every group are completed in the order this process launched them
RING_PROGRESS = RingProgress()
