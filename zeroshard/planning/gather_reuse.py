"""Which stage-3 units the scale model takes as kept gathered from their forward to their backward
(``stage3_max_reuse_distance``), so that their backward gather never runs.

[Note: units kept from forward to backward]
Stage 3 releases a unit after its forward unless the order recorded on the previous pass uses it again
within ``stage3_max_reuse_distance`` elements ([Note: recorded order and divergence] in
sharding/stage3/gather_scheduler.py): a kept unit is still gathered when backward reaches it, and its
backward all-gather does not run.  Between a unit's forward and its backward run the forwards of the
units after it and their backwards, so its distance is twice their elements.  The scale model takes the
buckets in the order it is given as backward's (the engine's bucket order: reverse registration), so
forward runs them in reverse and a bucket's distance is twice the elements of the buckets before it in
the list; a unit is kept where that is below the limit.  This is the steady state: the first pass of a
job has no recorded order and gathers every unit again for backward.  ``stage3_max_live_parameters``
(1e9 by default), which also stops keeping, is taken as not binding; DeepSpeed's defaults (1e9 for
both) keep every unit of a model under 5e8 elements, and ZeRO-3 at scale (units of far more than the
distance between them) keeps none, which is what the model counts when it is not given the limit.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["kept_through_backward"]


def kept_through_backward(numels: Sequence[int], max_reuse_distance: Optional[int]) -> list[bool]:
    """For each bucket of ``numels`` (backward's order), whether it stays gathered from its forward to its
    backward under ``max_reuse_distance`` (None: none does); see [Note: units kept from forward to
    backward]."""
    kept, before = [], 0
    for numel in numels:
        kept.append(max_reuse_distance is not None and 2 * before < max_reuse_distance)
        before += numel
    return kept
