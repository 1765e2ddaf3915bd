"""The self-test's table on stdout: one section per check, then the verdict."""

from __future__ import annotations

from typing import Any, Optional

from .memory import peak_bound

MIB = 2**20


def _num(value: Optional[float], spec: str = ".2e") -> str:
    return "-" if value is None else format(value, spec)


def _mib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / MIB:,.1f}"


def _header(results: dict[str, Any], wall_s: float) -> list[str]:
    env = results.get("environment", {})
    where = env.get("gpu") or f"{env.get('cpus')} CPUs"
    return [f"zeroshard selftest: {env.get('world_size')} rank(s) on {env.get('device')} ({env.get('backend')}, "
            f"{where}, {env.get('nodes')} node(s)), torch {env.get('torch')}, zeroshard {env.get('zeroshard')}; "
            f"{wall_s:.1f} s", ""]


def _correctness(results: dict[str, Any]) -> list[str]:
    bounds = results.get("bounds", {})
    cases = results.get("correctness") or []
    steps = cases[0]["steps"] if cases else "?"
    lines = [f"correctness: {steps} steps against one process on the global batch and DDP (fp32: max relative "
             f"difference, bound {bounds.get('fp32_rel', '?')}; bf16 against fp32: deviation, bound "
             f"{bounds.get('bf16_deviation', '?')}, loss bound {bounds.get('bf16_loss', '?')}); model states "
             f"summed over the ranks against N x the ZeRO formula",
             "| stage | precision | accum | vs one process | vs DDP | loss diff | model states (bytes) | formula x N "
             "| result |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in cases:
        precision = f"{c['precision']} + FP8" if c.get("fp8") else c["precision"]
        lines.append(f"| {c['stage']} | {precision} | {c['accumulation']} | {_num(c['vs_one_process'])} | "
                     f"{_num(c['vs_ddp'])} | {_num(c['loss_diff'])} | {c['model_states_sum']:,.0f} | "
                     f"{c['formula_sum']:,.0f} | {'pass' if c.get('passed') else 'FAIL'} |")
    return lines + [""]


def _throughput(results: dict[str, Any]) -> list[str]:
    records = results.get("throughput") or []
    lines = [f"throughput, memory and host syncs: model {results.get('size')} ({results.get('size_params', 0) / 1e6:.3g}M "
             f"parameters), {results.get('precision')}, {results.get('steps')} timed steps after "
             f"{results.get('warmup')}; model states per rank (rank 0) against the formula",
             "| implementation | tokens/s | step (s) | host reads/step | device syncs/step | model states (MiB) "
             "| formula (MiB) | device peak (MiB) | peak bound (MiB) | result |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        if "unavailable" in r:
            lines.append(f"| {r['implementation']} | unavailable: {r['unavailable']} | | | | | | | | |")
            continue
        estimate = r.get("device_estimate")
        result = "" if "passed" not in r else ("pass" if r["passed"] else "FAIL")
        lines.append(f"| {r['implementation']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | "
                     f"{r['host_reads_per_step']:g} | {_num(r['device_syncs_per_step'], 'g')} | "
                     f"{_mib(r.get('model_states_rank0'))} | {_mib(r.get('formula'))} | "
                     f"{_mib(r['device_peak_bytes'])} | {_mib(None if estimate is None else peak_bound(estimate))} | "
                     f"{result} |")
    return lines + [""]


def _bandwidth(results: dict[str, Any]) -> list[str]:
    rows = results.get("bandwidth") or []
    if not rows:
        return ["collectives: not measured (a world of one rank)", ""]
    lines = ["collectives (zeroshard's all-gather and reduce-scatter; median, slowest rank)",
             "| scope | op | ranks | MiB | time (ms) | algbw (GB/s) | busbw (GB/s) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['scope']} | {r['op']} | {r['ranks']} | {r['bytes'] / MIB:g} | {r['seconds'] * 1e3:.2f} | "
                     f"{r['algbw_gb_s']:.2f} | {r['busbw_gb_s']:.2f} |")
    return lines + [""]


def format_report(results: dict[str, Any], wall_s: float) -> str:
    """``results`` as judged by tools/selftest/verdict.py, as text."""
    failures = results.get("failures", [])
    verdict = ["verdict: PASS" if not failures else f"verdict: FAIL ({len(failures)} check(s))",
               *(f"  - {f}" for f in failures)]
    return "\n".join(_header(results, wall_s) + _correctness(results) + _throughput(results) + _bandwidth(results)
                     + verdict)
