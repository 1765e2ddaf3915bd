"""Who we are in the job: rank, world size, device and process group, in one object that is passed around.

zeroshard never keeps process groups in globals of its own: the engine builds one :class:`World` and
hands it to every part that communicates.  Launching is torchrun's job (``env://``); a single process
started without torchrun gets a world of size 1 with no process group at all.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class World:
    """The data-parallel world this rank belongs to."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # "gloo", "nccl" or "none" for a lone process without a process group
    group: Optional[dist.ProcessGroup] = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _pick_backend() -> tuple[str, torch.device]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and dist.is_nccl_available():
        torch.cuda.set_device(local_rank)
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """Join (or create) the default process group and describe it.

    - Already initialised (by the user or an earlier call): reuse it.
    - Started by torchrun (``RANK``/``WORLD_SIZE`` set): ``init_process_group`` with ``env://``,
      NCCL when CUDA is available, gloo otherwise; ``backend`` overrides the choice.
    - A lone process: a world of size 1 without a process group (no collectives are ever issued).

    ``timeout_s`` bounds every collective, so a desynchronised job fails instead of hanging.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized() and _launched_by_torchrun():
        chosen, _ = _pick_backend()
        dist.init_process_group(backend=backend or chosen, init_method="env://",
                                timeout=datetime.timedelta(seconds=timeout_s))
    if not dist.is_initialized():
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        return World(0, 1, 0, device, "none", None, timeout_s)
    used = dist.get_backend()
    device = torch.device("cuda", local_rank) if used == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return World(dist.get_rank(), dist.get_world_size(), local_rank, device, used,
                 dist.group.WORLD, timeout_s)
