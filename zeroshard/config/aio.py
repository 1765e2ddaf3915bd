"""DeepSpeed's ``aio`` block: its libaio tuning for NVMe swaps, accepted where it asks for nothing.

[Note: the aio block]
DeepSpeed's ``aio`` keys tune its asynchronous I/O library: the block size and queue depth of libaio
submissions, how many threads split one request, whether requests go one by one or as a batch, and
GPUDirect Storage.  zeroshard's swap files are read and written whole with buffered ``pread`` /
``pwrite`` on one I/O thread that overlaps the swaps with compute ([Note: swap files] in
offload/swap_files.py): none of those knobs exists.  Libraries write the block out in full with
DeepSpeed's defaults whether or not anything is offloaded (Lightning's ``DeepSpeedStrategy`` always
does), so a key at DeepSpeed's default, which asks for nothing beyond what zeroshard does, is dropped;
any other value would do nothing here and is refused by name.  ``thread_count`` is DeepSpeed's older
name of ``intra_op_parallelism`` (one thread per request: zeroshard's one I/O thread).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from .errors import ConfigError

__all__ = ["AIO_DEFAULTS", "check_aio"]

#: DeepSpeed's ``aio`` keys and defaults (``deepspeed/runtime/swap_tensor/constants.py``)
AIO_DEFAULTS: dict[str, Any] = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                                "single_submit": False, "overlap_events": True, "use_gds": False}

#: DeepSpeed's older spellings of ``aio`` keys
_ALIASES = {"thread_count": "intra_op_parallelism"}

#: why a value other than DeepSpeed's default would do nothing in zeroshard
_WHY: dict[str, str] = {
    "block_size": "zeroshard reads and writes each swap file whole (buffered pread/pwrite), in no libaio blocks",
    "queue_depth": "zeroshard submits no libaio queue: one I/O thread reads and writes each swap file in turn",
    "intra_op_parallelism": "zeroshard's swaps run on one I/O thread; a request is never split over threads",
    "single_submit": "zeroshard submits no libaio requests; its I/O thread takes them one by one in order",
    "overlap_events": "zeroshard's I/O thread always overlaps the swaps with compute",
    "use_gds": "zeroshard has no GPUDirect Storage path; swaps go through host memory",
}


def check_aio(block: Any) -> None:
    """Accept an ``aio`` block whose every key states DeepSpeed's default; refuse any other key or value
    by name ([Note: the aio block])."""
    if block is None:
        return
    if not isinstance(block, Mapping):
        raise ConfigError(f"'aio' must be a JSON object, got {json.dumps(block)}")
    seen: dict[str, str] = {}
    for given, value in block.items():
        name = _ALIASES.get(given, given)
        if name not in AIO_DEFAULTS:
            raise ConfigError(f"unknown config key 'aio.{given}'; DeepSpeed's aio keys are "
                              f"{', '.join(sorted([*AIO_DEFAULTS, *_ALIASES]))}")
        if name in seen:
            raise ConfigError(f"both 'aio.{seen[name]}' and 'aio.{given}' are set; they are the same key under two "
                              f"names: keep 'aio.{name}'")
        seen[name] = given
        default = AIO_DEFAULTS[name]
        if value != default or type(value) is not type(default):
            raise ConfigError(f"'aio.{given}' = {json.dumps(value)} would do nothing: {_WHY[name]}; set it to "
                              f"DeepSpeed's default {json.dumps(default)} or remove it")
