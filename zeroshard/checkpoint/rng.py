"""This process's random number generators (torch's CPU generator and every CUDA device's), captured and
put back: ``load_checkpoint`` uses it to leave them alone unless asked (see [Note: who owns the random
number generators on resume] in engine/checkpoints.py)."""

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


class RNGState:
    """torch's generators as a checkpoint part: saved per rank, restored only into the same world size
    (a rank's stream belongs to that rank)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {"rng.torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["rng.cuda"] = torch.cuda.get_rng_state()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "rng.torch" in state:
            torch.set_rng_state(state["rng.torch"])
        if "rng.cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng.cuda"])
