"""Timed training steps on random tokens with the all-to-all bytes each one sent: the loop bench_moe.py
(experts' token exchange) and bench_muon.py (whole matrices to their owners) both measure."""

from __future__ import annotations

import time
from typing import Any


def timed_steps(engine: Any, vocab: int, seq: int, micro: int, steps: int, warmup: int,
                seed: int) -> tuple[list[float], list[int]]:
    """``warmup + steps`` steps of ``micro`` random sequences; the seconds and all-to-all bytes sent of
    each measured one (after ``warmup``)."""
    import torch

    from zeroshard.distributed.collectives import CommKind

    g = torch.Generator().manual_seed(seed)
    times, sent = [], []
    for step in range(warmup + steps):
        x = torch.randint(0, vocab, (micro, seq), generator=g)
        y = torch.randint(0, vocab, (micro, seq), generator=g)
        before = engine.comm.counters[CommKind.ALL_TO_ALL].bytes_sent
        start = time.perf_counter()
        engine.backward(engine(x, y))
        engine.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
            sent.append(engine.comm.counters[CommKind.ALL_TO_ALL].bytes_sent - before)
    return times, sent
