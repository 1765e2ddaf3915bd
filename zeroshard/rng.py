"""This process's random number generators (torch's CPU generator and every CUDA device's), captured and
put back: ``load_checkpoint`` uses it to leave them alone unless asked (see [Note: who owns the random
number generators on resume] in engine.py)."""

from __future__ import annotations

from typing import Optional

import torch

RngStates = tuple[torch.Tensor, Optional[list[torch.Tensor]]]


def rng_states() -> RngStates:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def set_rng_states(states: RngStates) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state_all(states[1])
