"""Periodic checkpoints (``checkpoint.save_interval``) and which of them to keep (``checkpoint.keep_last``).

[Note: pruning never loses the checkpoint to resume from]
Pruning runs on rank 0 only after a save has been published (``latest`` names it), and removes the
oldest periodic checkpoints (directories named ``global_step<N>``, as periodic saves name them) beyond
``keep_last``; the one ``latest`` names is never removed, and tags a script saved under its own names
are never touched.  A doomed directory is first renamed to ``.<tag>.deleting`` (one atomic step: a
crash leaves either the whole checkpoint or a name no load looks at), then deleted; a later prune
clears what a crash left behind.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from .format import LATEST, MANIFEST

_PERIODIC = re.compile(r"global_step(\d+)")


def periodic_checkpoints(root: Path) -> list[Path]:
    """The complete periodic checkpoints under ``root``, oldest first."""
    found = []
    for directory in root.iterdir() if root.is_dir() else ():
        match = _PERIODIC.fullmatch(directory.name)
        if match and (directory / MANIFEST).is_file():
            found.append((int(match.group(1)), directory))
    return [d for _, d in sorted(found)]


def prune(root: Path, keep_last: int) -> list[Path]:
    """Remove all but the newest ``keep_last`` periodic checkpoints (see the Note); returns the removed."""
    for leftover in root.glob(".global_step*.deleting"):
        shutil.rmtree(leftover, ignore_errors=True)
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    removed = []
    for directory in periodic_checkpoints(root)[:-keep_last]:
        if directory.name == latest:
            continue
        doomed = directory.with_name(f".{directory.name}.deleting")
        os.replace(directory, doomed)
        shutil.rmtree(doomed)
        removed.append(directory)
    return removed
