"""`zeroshard selftest`: two CPU ranks under torchrun pass every check and say so in the JSON; a result
over a bound fails the run (exit status 1) and names the check; the ranks' device counts are checked
before anything launches."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from zeroshard.tools import cli
from zeroshard.tools.selftest import command
from zeroshard.tools.selftest.verdict import Bounds, judge

STAGES, PRECISIONS, ACCUMULATIONS = range(4), ("fp32", "bf16"), (1, 2)


def selftest(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "selftest", *args], capture_output=True,
                          text=True, timeout=400, env=env)


@pytest.mark.slow  # extended: runs in CI (see conftest.py); about 45 s on 2 cores
def test_selftest_passes_on_two_cpu_ranks(tmp_path: Path) -> None:
    out = tmp_path / "selftest.json"
    proc = selftest("--device", "cpu", "--nproc", "2", "--steps", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: PASS" in proc.stdout and out.with_suffix(".png").is_file()
    results = json.loads(out.read_text())
    assert results["passed"] and results["failures"] == [] and results["environment"]["world_size"] == 2
    cases = [c for c in results["correctness"] if not c.get("fp8")]
    assert sorted((c["stage"], c["precision"], c["accumulation"]) for c in cases) == \
        sorted((s, p, a) for s in STAGES for p in PRECISIONS for a in ACCUMULATIONS)
    for c in cases:
        assert c["passed"] and c["vs_one_process"] is not None and c["vs_ddp"] is not None, c
        assert c["model_states_sum"] == pytest.approx(c["formula_sum"], rel=1e-9), c
    # FP8 (torchao is in the test extra): stage 3 against one process, and timed beside stage 3
    fp8 = [c for c in results["correctness"] if c.get("fp8")]
    assert [(c["stage"], c["fp8"]) for c in fp8] == [(3, "tensorwise")], fp8
    assert all(c["passed"] and c["vs_one_process"] <= 1e-5 for c in fp8), fp8
    assert [r["tokens_per_s"] > 0 for r in results["throughput"] if r.get("fp8")] == [True]
    zero = [r for r in results["throughput"] if r["implementation"].startswith("stage") and not r.get("fp8")]
    assert [r["stage"] for r in zero] == [0, 1, 2, 3] and all(r["passed"] for r in zero)
    assert {r["implementation"] for r in results["throughput"]} >= {"ddp", "fsdp2"}
    assert all(r["tokens_per_s"] > 0 for r in results["throughput"])
    check_host_reads(results["throughput"])
    assert {(r["scope"], r["op"]) for r in results["bandwidth"]} == {("world", "all_gather"),
                                                                      ("world", "reduce_scatter")}


def check_host_reads(throughput: list[dict[str, Any]]) -> None:
    """On CPU every read is counted: none in DDP's and FSDP2's steps; in a zeroshard step the engine's one
    read of the step ([Note: one host read per optimizer step] in engine/optimizer_step.py), one read of each
    consistency check's gathered table (backward and step, and forward at stage 3), and at stage 3 only
    the gather rounds' tables."""
    for r in throughput:
        steps, by_file = r["counted_steps"], Counter[str]()
        for site, reads in r["host_read_sites"].items():
            by_file[site.rpartition(":")[0]] += reads
        assert r["host_reads_per_step"] == sum(by_file.values()) / steps, r
        if not r["implementation"].startswith("stage"):
            assert by_file == {}, r
            continue
        rounds = by_file.pop("zeroshard/sharding/stage3/gather_agreement.py", 0)
        assert (rounds > 0) == (r["stage"] == 3), r
        assert by_file == {"zeroshard/engine/optimizer_step.py": steps,
                           "zeroshard/distributed/consistency.py": (3 if r["stage"] == 3 else 2) * steps}, r


def passing_results() -> dict[str, Any]:
    """What rank 0 writes, cut to what the verdict reads."""
    cases = [{"stage": s, "precision": p, "accumulation": a, "steps": 20,
              "metric": "max_rel_diff" if p == "fp32" else "deviation",
              "vs_one_process": 3e-6 if p == "fp32" else 0.03, "vs_ddp": 2e-6 if p == "fp32" else 0.03,
              "loss_diff": 3e-4, "model_states_sum": 1000.0, "formula_sum": 1000.0, "num_params": 10}
             for s in STAGES for p in PRECISIONS for a in ACCUMULATIONS]
    zero = [{"implementation": f"stage {s}", "stage": s, "tokens_per_s": 1.0, "step_s": 1.0,
             "host_reads_per_step": 1.0, "device_syncs_per_step": None, "device_peak_bytes": None,
             "model_states_rank0": 500.0, "model_states_sum": 1000.0, "formula": 500.0, "formula_sum": 1000.0,
             "device_estimate": None} for s in STAGES]
    return {"environment": {"world_size": 2, "device": "cpu"}, "size": "tiny", "size_params": 10,
            "precision": "fp32", "steps": 1, "warmup": 1, "correctness": cases, "throughput": zero, "bandwidth": []}


def test_the_verdict_fails_each_check_over_its_bound() -> None:
    good = passing_results()
    assert judge(good)[1] == []
    assert len(judge(good, Bounds(fp32_rel=1e-7))[1]) == 16  # 8 fp32 cases x 2 references
    broken = copy.deepcopy(good)
    broken["correctness"][3]["loss_diff"] = float("nan")  # stage 0 bf16 accumulation 2
    broken["throughput"][2]["model_states_sum"] = 1001.0
    broken["throughput"][3].update(device_peak_bytes=10 * 2**30, device_estimate=2**30)
    judged, failures = judge(broken)
    assert failures == ["stage 0 bf16 accumulation 2: loss difference nan exceeds 0.002",
                        "stage 2 (tiny): model states 1,001 bytes summed over the ranks, the formula says 1,000",
                        "stage 3: device peak 10,240 MiB is over the bound 2,048 MiB (estimate 1,024 MiB)"]
    assert not judged["passed"] and not judged["correctness"][3]["passed"] and judged["correctness"][2]["passed"]
    assert judge({**good, "correctness": []})[1] == ["correctness: no case ran"]


@pytest.mark.parametrize("bound_broken, status", [(False, 0), (True, 1)])
def test_the_exit_status_follows_the_verdict(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any,
                                             bound_broken: bool, status: int) -> None:
    results = passing_results()
    if bound_broken:
        results["correctness"][0]["vs_one_process"] = 2e-5
    monkeypatch.setattr(command, "launch", lambda run, extra: (0, results))
    out = tmp_path / "st.json"
    assert cli.main(["selftest", "--device", "cpu", "--json", str(out)]) == status
    assert json.loads(out.read_text())["passed"] is not bound_broken
    printed = capsys.readouterr().out
    assert ("verdict: PASS" in printed) is not bound_broken
    assert ("stage 0 fp32 accumulation 1: max_rel_diff 2e-05 against one process exceeds 1e-05" in printed) \
        is bound_broken


def test_ranks_beyond_the_gpus_are_refused_before_launching() -> None:
    args = cli.build_parser().parse_args(["selftest", "--nproc", "3"])
    with pytest.raises(SystemExit, match="has 2 CUDA device"):
        command.resolve(args, cuda_devices=2)
    assert command.resolve(cli.build_parser().parse_args(["selftest"]), cuda_devices=2)["nproc"] == 2
    cpu = command.resolve(cli.build_parser().parse_args(["selftest", "--size", "300m"]), cuda_devices=0)
    assert (cpu["device"], cpu["nproc"], cpu["size"]) == ("cpu", 2, "350m")
    assert cli._demo_nproc(None, cuda_devices=1) == 1 and cli._demo_nproc(None, cuda_devices=0) == 2
    with pytest.raises(SystemExit, match="--nproc 1 or fewer"):
        cli._demo_nproc(2, cuda_devices=1)


def test_host_reads_are_counted_where_they_happen_and_the_patches_undone() -> None:
    import torch

    import zeroshard
    from zeroshard.tools.selftest.syncs import SOURCE_ROOT, SyncCounter

    root = Path(zeroshard.__file__).resolve().parents[1]  # sites are named relative to the package's parent
    assert SOURCE_ROOT == root
    here = Path(__file__).resolve()
    named = here.relative_to(root).as_posix() if here.is_relative_to(root) else __file__
    t = torch.ones(3)
    line = sys._getframe().f_lineno + 2
    with SyncCounter(torch.device("cpu")) as counter:
        t.sum().item(), float(t[0]), bool(t[1]), t.tolist(), int(t[2])
    assert counter.reads == 5 and counter.device_syncs is None
    assert counter.sites == {f"{named}:{line}": 5}  # all five on that one line
    assert not {"item", "__float__", "__bool__", "tolist", "__int__"} & set(torch.Tensor.__dict__)
    t[0].item()
    assert counter.reads == 5


#: run from a copy of the checkout: counts a read on its own line 6 and one inside the package
COUNT_IN_A_COPY = """import json, sys, torch
from zeroshard.pipeline.p2p import decode_header, encode_header
from zeroshard.tools.selftest.syncs import SyncCounter
header = encode_header((torch.ones(2, 3),))
with SyncCounter(torch.device("cpu")) as counter:
    float(header[0]), decode_header(header)
print(json.dumps(dict(counter.sites)))
"""


def test_sites_are_named_alike_in_a_checkout_folder_named_zeroshard(tmp_path: Path) -> None:
    """A clone's folder is named after the package: a site is still named from the package's parent,
    never by searching its path for the package's name."""
    import shutil

    import zeroshard

    checkout = tmp_path / "zeroshard"  # what `git clone` names it
    shutil.copytree(Path(zeroshard.__file__).parent, checkout / "zeroshard",
                    ignore=shutil.ignore_patterns("__pycache__"))
    script = checkout / "tests" / "count.py"
    script.parent.mkdir()
    script.write_text(COUNT_IN_A_COPY)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(checkout)})
    assert proc.returncode == 0, proc.stderr
    sites = json.loads(proc.stdout)
    assert sites.pop("tests/count.py:6") == 1
    [(site, reads)] = sites.items()  # decode_header's one read of the header
    assert site.startswith("zeroshard/pipeline/p2p.py:") and reads == 1, sites


@pytest.mark.cuda
def test_selftest_and_demo_on_cuda(tmp_path: Path) -> None:
    from conftest import cuda_env

    out = tmp_path / "selftest.json"
    proc = selftest("--device", "cuda", "--nproc", "1", "--size", "tiny", "--json", str(out), env=cuda_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    assert results["environment"]["device"] == "cuda" and results["passed"]
    assert all(r.get("device_syncs_per_step") is not None for r in results["throughput"] if "tokens_per_s" in r)
    demo = subprocess.run([sys.executable, "-m", "zeroshard.tools.cli", "demo", "--nproc", "1", "--steps", "5",
                           "--out", str(tmp_path / "demo")], capture_output=True, text=True, timeout=300,
                          env=cuda_env())
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "---- sample ----" in demo.stdout
