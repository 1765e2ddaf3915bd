"""Expert parallelism: which ranks exchange tokens and which hold the same experts (the exchange itself:
distributed/exchange.py).

[Note: experts sharded over the ranks that hold them]
With ``ep_size`` P > 1 the ranks of a data-parallel world of N are cut, as DeepSpeed numbers them,
into blocks of P consecutive ranks (the *expert-parallel* groups): inside a block each rank holds
``num_experts / P`` experts of every MoE layer, rank e the e-th share, and tokens travel to their
expert's rank and back by all-to-all.  The ranks at the same position of every block hold the same
experts (the *expert-data-parallel* groups, N / P ranks); the job's axes lay both out
(``ParallelDims.positions``: ``expert``, ``expert_data``; see [Note: the order of the axes] in
distributed/parallel_dims.py).  ZeRO treats the two kinds of parameters
apart, in buckets of their own: the dense parameters are sharded over all N ranks as usual, each
expert bucket over its expert-data-parallel group only (``BucketLayout.experts``; the strategy reduces
and gathers it there, ``ShardingStrategy.comm_of``), so an expert's state is split N / P ways (not at
all when P = N: each expert then lives on one rank, with all its optimizer state).  Gradients are
still averaged over all N ranks: an expert's gradient on its rank already sums the contributions of
the P ranks whose tokens it processed (the all-to-all's backward brings them), the reduction adds the
N / P groups' sums, and dividing by N gives the gradient of the mean loss, as one process computing
every rank's batch would.  The gradient norm counts each expert once: at stages 1-3 every rank owns a
distinct chunk of some expert bucket, and at stage 0 the experts' squares are summed over the
expert-parallel group (``optim/clipping.py: ExpertsNorm``).  At start-up each expert-data-parallel
group starts from its first rank's experts, as the data-parallel world starts from rank 0's values.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

from ..distributed.collectives import Collectives
from ..distributed.exchange import exchange
from ..distributed.parallel_dims import ExpertParallelError

__all__ = ["ExpertParallelError", "ExpertGroupRecord", "register_expert_groups", "live_expert_groups", "exchange"]


@dataclass(frozen=True)
class ExpertGroupRecord:
    """The groups of one engine's expert parallelism, as DeepSpeed's ``deepspeed.utils.groups`` names them."""

    exchange: Collectives  # expert-parallel: the ranks that exchange tokens
    experts_data: Collectives  # expert-data-parallel: the ranks holding the same experts
    data: Collectives  # every data-parallel rank


class _Holder:
    """Keeps a record for as long as its engine lives (the engine holds the holder)."""

    def __init__(self, name: str, record: ExpertGroupRecord) -> None:
        self.name, self.record = name, record


_LIVE: "weakref.WeakValueDictionary[str, _Holder]" = weakref.WeakValueDictionary()


def register_expert_groups(ep_size: int, record: ExpertGroupRecord) -> _Holder:
    """Make an engine's groups answer ``deepspeed.utils.groups`` under ``ep_size_P``; they are forgotten
    when the returned holder (kept by the engine) goes."""
    holder = _Holder(f"ep_size_{ep_size}", record)
    _LIVE[holder.name] = holder
    return holder


def live_expert_groups() -> dict[str, ExpertGroupRecord]:
    """The groups of the live engines, by name."""
    return {name: holder.record for name, holder in list(_LIVE.items())}
