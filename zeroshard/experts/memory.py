"""The memory breakdown of an expert-parallel engine: this rank's experts apart from the dense model.

The engine's breakdown counts every bucket together; here the experts' buckets are counted alone, per
category as the engine counts it (parameters whole below stage 3 and this rank's chunk at stage 3,
gradients full-size at stages 0-1 and chunked at 2-3, optimizer state over the elements this rank
updates), and the ZeRO formula is taken for the two parts over their own groups: the dense part over
every data-parallel rank, the experts over the ranks holding the same experts (see [Note: experts
sharded over the ranks that hold them] in experts/groups.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..planning import model_state_bytes

if TYPE_CHECKING:
    from ..sharding import ShardingStrategy


def expert_breakdown(strategy: "ShardingStrategy", optimizer_real: float, precision: str, grad_size: int,
                     optimizer_bytes: int | None) -> dict[str, float]:
    """``expert_params``, ``expert_grads``, ``expert_optimizer`` (this rank's bytes of its experts' state),
    ``expert_model_states``, ``dense_model_states`` and the two parts' formulas; ``optimizer_real``: the
    engine's optimizer bytes over every bucket."""
    stage, buckets = strategy.stage, strategy.layout.buckets
    experts = [b for b in buckets if b.experts]
    owned = {b.index: strategy.owned_real(b) for b in buckets}
    param_size = strategy.storage.dtype.itemsize
    params = sum(owned[b.index] if stage == 3 else b.numel for b in experts) * param_size
    grads = sum(owned[b.index] if stage >= 2 else b.numel for b in experts) * grad_size
    every_owned = sum(owned.values())
    optimizer = optimizer_real * sum(owned[b.index] for b in experts) / every_owned if every_owned else 0.0
    expert_numel = sum(b.numel for b in experts)
    spread = experts[0].world_size if experts else 1
    dense_numel = strategy.layout.numel - expert_numel
    return {
        "expert_params": params, "expert_grads": grads, "expert_optimizer": optimizer,
        "expert_model_states": params + grads + optimizer,
        "expert_formula": model_state_bytes(stage, expert_numel, spread, precision, grad_size, optimizer_bytes).total,
        "dense_formula": model_state_bytes(stage, dense_numel, strategy.world.world_size, precision, grad_size,
                                           optimizer_bytes).total,
    }
