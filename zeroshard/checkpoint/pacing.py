"""Pacing an asynchronous save's writing by the optimizer steps it overlaps.

[Note: a save spread over steps]
An asynchronous save costs CPU time while it writes (the checksum, the copy into the direct-I/O
buffer, and on a virtual machine the disk I/O itself takes vCPU time from the guest), and it
overlaps the training steps that follow.  Written as fast as it goes, nearly all of that cost falls
on the first of those steps (measured in benchmarks/RESULTS.md, section "Asynchronous checkpoint
saves").  With ``checkpoint.writer.spread_over_steps: N`` the
writer lets itself write at most 1/N of the save's bytes per optimizer step: the first 1/N at once,
the next after the engine's next optimizer step, and so on, so that the cost is shared by N steps
and the checkpoint is published within N steps.  Whatever waits for the save (the next save, a load,
``wait_for_checkpoint()``, ``close()``, interpreter exit) lifts the pace first: a wait is never
stretched.  The copy of the state into the staging buffers is not paced: the next optimizer step
waits for it.
"""

from __future__ import annotations

import threading


class StepPacing:
    """The bytes a background writer may have written by now: ``total / steps`` per optimizer step.

    The writer calls :meth:`take` before each piece it writes, the engine :meth:`stepped` after each
    optimizer step, whoever waits for the save :meth:`lift`.  A piece starts while the allowance is not
    used up, so a piece larger than the allowance still goes, and the save ends within ``steps`` steps.
    """

    def __init__(self, steps: int) -> None:
        self._steps = max(1, steps)
        self._changed = threading.Condition()
        self._total = 0
        self._taken = 0
        self._stepped = 0
        self._lifted = self._steps == 1

    @property
    def paced(self) -> bool:
        """Whether the writer may be held back (False: one step, or lifted)."""
        return not self._lifted

    def begin(self, total: int) -> None:
        """The save writes ``total`` bytes; none of them written yet."""
        with self._changed:
            self._total, self._taken = total, 0

    def take(self, nbytes: int) -> None:
        """Block until the writer may write ``nbytes`` more bytes, then count them."""
        with self._changed:
            self._changed.wait_for(lambda: self._lifted or self._taken < self._allowance())
            self._taken += nbytes

    def _allowance(self) -> int:
        return -(-self._total * (self._stepped + 1) // self._steps)

    def stepped(self) -> None:
        """One optimizer step more: the writer may write the next ``total / steps`` bytes."""
        with self._changed:
            self._stepped += 1
            self._changed.notify_all()

    def lift(self) -> None:
        """Write the rest as fast as it goes (someone waits for the save)."""
        with self._changed:
            self._lifted = True
            self._changed.notify_all()
