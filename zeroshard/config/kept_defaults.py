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

[Note: defaults that differ from DeepSpeed's]
Every other default is the reported release's, as DeepSpeed computes it from a config that leaves the
key out (tests/unit/test_deepspeed_defaults.py sets the schema beside DeepSpeed's values as read by
tests/fixtures/deepspeed/read_defaults.py).  :data:`DIFFERENT_DEFAULTS` lists the keys whose default
differs on purpose, each with its reason; none changes what a step computes (``overlap_comm`` changes
when communication runs, not what it sums), so none is announced.  :data:`QUIET_MOVES` lists keys whose
default a later DeepSpeed moved where zeroshard keeps the reported release's without a word, for the
same reason; a moved default that changes training belongs in :data:`MOVED_DEFAULTS` instead.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from ..logging import log_rank

__all__ = ["DIFFERENT_DEFAULTS", "MOVED_DEFAULTS", "MovedDefault", "QUIET_MOVES", "announce_kept_defaults"]


class MovedDefault(NamedTuple):
    kept: Any  # zeroshard's default: DeepSpeed's until `since`
    later: Any  # DeepSpeed's default from `since` on
    since: str  # the DeepSpeed release that moved it
    meaning: str  # what zeroshard's default does, for the message


#: top-level keys whose DeepSpeed default moved after the release zeroshard reports
MOVED_DEFAULTS: dict[str, MovedDefault] = {
    "gradient_clipping": MovedDefault(0.0, 1.0, "0.19.3", "gradients are not clipped"),
}

#: key paths whose default differs from the reported release's on purpose, with the reason
DIFFERENT_DEFAULTS: dict[str, str] = {
    "zero_optimization.overlap_comm":
        "on at every stage, where DeepSpeed turns it on at stage 3 only ([Note: defaults] in config/schema.py)",
    "steps_per_print":
        "10, as DeepSpeed's configuration documentation gives it; DeepSpeed's code reads null (no progress "
        "log); logging only",
    "zero_optimization.offload_optimizer.nvme_path":
        "`/local_nvme`, as DeepSpeed's configuration documentation gives it; DeepSpeed's code leaves it unset",
    "zero_optimization.offload_param.nvme_path":
        "`/local_nvme`, as DeepSpeed's configuration documentation gives it; DeepSpeed's code leaves it unset",
    "pipeline.stages": "unset means the `PipelineModule`'s own value, which a set key must equal",
    "pipeline.partition": "unset means the `PipelineModule`'s own value, which a set key must equal",
    "pipeline.seed_layers": "unset means the `PipelineModule`'s own value, which a set key must equal",
    "pipeline.activation_checkpoint_interval": "unset means the `PipelineModule`'s own value, which a set key must "
                                               "equal",
}

#: key paths whose default a later DeepSpeed moved, kept at the reported release's without a word, with the reason
QUIET_MOVES: dict[str, str] = {
    "zero_optimization.offload_optimizer.pin_memory": "page-locking changes copy speed on CUDA, not results",
    "zero_optimization.offload_param.pin_memory": "page-locking changes copy speed on CUDA, not results",
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
