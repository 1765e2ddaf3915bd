"""Defaults zeroshard keeps where a later DeepSpeed release moved them, said once when a config leaves
the key out.

[Note: a default that DeepSpeed moved]
zeroshard answers libraries as DeepSpeed 0.18.2 (``DEEPSPEED_VERSION`` in deepspeed/install.py), and its
defaults are that release's.  DeepSpeed 0.19.3 moved one: ``gradient_clipping``, 0 (off) until then,
1.0 from then on (``GRADIENT_CLIPPING_DEFAULT`` in DeepSpeed's runtime/constants.py).  zeroshard keeps 0:
it is the default of the version it reports, every zeroshard config written so far trains as it did,
and clipping that no config asked for would change training without a word.  A script written for a
newer DeepSpeed that leaves the key out would clip there and not here, so ``initialize()`` says so once
per process when a config leaves out a key whose default moved, with the value to write for DeepSpeed's
newer behaviour.  Configs that set the key (Hugging Face's ``"auto"``, which the Trainer fills, and
Lightning's, which always writes it) hear nothing.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from ..logging import log_rank

__all__ = ["MOVED_DEFAULTS", "MovedDefault", "announce_kept_defaults"]


class MovedDefault(NamedTuple):
    kept: Any  # zeroshard's default: DeepSpeed's until `since`
    later: Any  # DeepSpeed's default from `since` on
    since: str  # the DeepSpeed release that moved it
    meaning: str  # what zeroshard's default does, for the message


#: top-level keys whose DeepSpeed default moved after the release zeroshard reports
MOVED_DEFAULTS: dict[str, MovedDefault] = {
    "gradient_clipping": MovedDefault(0.0, 1.0, "0.19.3", "gradients are not clipped"),
}

_ANNOUNCED: set[str] = set()


def announce_kept_defaults(raw: Mapping[str, Any]) -> list[str]:
    """Say once per process, for each key of :data:`MOVED_DEFAULTS` that ``raw`` (the config as given)
    leaves out, which default zeroshard keeps; returns the keys announced now."""
    announced = []
    for key, moved in MOVED_DEFAULTS.items():
        if key in raw or key in _ANNOUNCED:
            continue
        _ANNOUNCED.add(key)
        announced.append(key)
        log_rank(f"{key!r} is not set: zeroshard keeps DeepSpeed's default before {moved.since}, {moved.kept} "
                 f"({moved.meaning}); DeepSpeed {moved.since} and later default to {moved.later}: set "
                 f"\"{key}\": {moved.later} for that")
    return announced
