"""Pass or fail: the bounds each check is held to, and every failure named.

Correctness (each case of [Note: how a case is measured] in tools/selftest/parity.py): fp32 within
``fp32_rel`` of both references; bf16 within the deviation and loss bounds that
tests/distributed/test_mixed_precision.py states for 16-bit training against fp32.  Memory: the
model-state bytes summed over the ranks equal N times the formula (exactly but for float rounding);
on CUDA the device's peak stays under the bound of [Note: the device-peak bound] in
tools/selftest/memory.py.  Host syncs, bandwidth and throughput are reported, not judged: what is
good depends on the machine.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any

from .memory import peak_bound


@dataclass(frozen=True)
class Bounds:
    fp32_rel: float = 1e-5
    bf16_deviation: float = 0.06
    bf16_loss: float = 2e-3
    model_states_rel: float = 1e-9


def case_name(case: dict[str, Any]) -> str:
    fp8 = f" + FP8 ({case['fp8']})" if case.get("fp8") else ""
    return f"stage {case['stage']} {case['precision']}{fp8} accumulation {case['accumulation']}"


def _case_failures(case: dict[str, Any], bounds: Bounds) -> list[str]:
    figures = [(ref, case[key]) for ref, key in (("one process", "vs_one_process"), ("DDP", "vs_ddp"))
               if case.get(key) is not None]
    if not figures:
        return [f"{case_name(case)}: no reference figure"]
    bound = bounds.fp32_rel if case["precision"] == "fp32" else bounds.bf16_deviation
    out = [f"{case_name(case)}: {case['metric']} {value:.3g} against {ref} exceeds {bound:g}"
           for ref, value in figures if not value <= bound]  # `not <=`: a NaN fails
    if case["precision"] != "fp32" and not case["loss_diff"] <= bounds.bf16_loss:
        out.append(f"{case_name(case)}: loss difference {case['loss_diff']:.3g} exceeds {bounds.bf16_loss:g}")
    return out


def _states_failure(label: str, record: dict[str, Any], bounds: Bounds) -> list[str]:
    measured, expected = record["model_states_sum"], record["formula_sum"]
    if abs(measured - expected) <= bounds.model_states_rel * expected:
        return []
    return [f"{label}: model states {measured:,.0f} bytes summed over the ranks, the formula says {expected:,.0f}"]


def _peak_failure(record: dict[str, Any]) -> list[str]:
    peak, estimate = record.get("device_peak_bytes"), record.get("device_estimate")
    if peak is None or estimate is None or peak <= peak_bound(estimate):
        return []
    return [f"{record['implementation']}: device peak {peak / 2**20:,.0f} MiB is over the bound "
            f"{peak_bound(estimate) / 2**20:,.0f} MiB (estimate {estimate / 2**20:,.0f} MiB)"]


def judge(results: dict[str, Any], bounds: Bounds = Bounds()) -> tuple[dict[str, Any], list[str]]:
    """``results`` with each case and record marked ``passed`` and the bounds recorded, and every failure
    (an empty list: the machine passes).  A missing section fails: a check that did not run passed nothing."""
    judged = copy.deepcopy(results)
    failures: list[str] = []
    cases = judged.get("correctness") or []
    if not cases:
        failures.append("correctness: no case ran")
    for case in cases:
        problems = _case_failures(case, bounds) + _states_failure(case_name(case), case, bounds)
        case["passed"] = not problems
        failures += problems
    zero = [r for r in judged.get("throughput") or [] if "model_states_sum" in r]
    if not zero:
        failures.append("memory: no zeroshard stage was measured on the --size model")
    for record in zero:
        problems = _states_failure(f"{record['implementation']} ({judged.get('size', '?')})", record, bounds) \
            + _peak_failure(record)
        record["passed"] = not problems
        failures += problems
    judged["bounds"] = asdict(bounds)
    judged["failures"] = failures
    judged["passed"] = not failures
    return judged, failures
