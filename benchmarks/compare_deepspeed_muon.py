"""DeepSpeed's Muon against zeroshard's on one DeepSpeed script: the loss of every step, both ways.

    .venv/bin/python benchmarks/compare_deepspeed_muon.py [--stages 1 2 3] [--steps 25] [--ns-method gram]
        [--deepspeed-python /work/dsvenv/bin/python] [--out benchmarks/out/deepspeed_muon.json]

``benchmarks/deepspeed_muon_script.py`` (a tiny GPT, deterministic data, DeepSpeed's ``"optimizer":
{"type": "Muon"}``, fp32, world 2, CPU and gloo) runs at each ZeRO stage under real DeepSpeed
(``torchrun`` of the virtual environment that has it) and under ``zeroshard run --as-deepspeed`` (this
one's).  DeepSpeed's Newton-Schulz functions are wrapped in ``torch.compile``; its runs here set
``TORCHDYNAMO_DISABLE=1`` (torch's own switch), so they run eagerly, the arithmetic the compiled
kernels stand for, without minutes of compiling per matrix shape on a CPU.  A stage at which DeepSpeed
fails is reported with its error.  Prints each step's losses and, per stage, the largest relative
difference and the final losses.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "deepspeed_muon_script.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(command: list[str], out: Path, env: dict[str, str]) -> dict[str, Any]:
    """One run: its losses, or the error it ended with."""
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800, env={**os.environ, **env})
    if proc.returncode != 0 or not out.exists():
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        return {"error": (errors or lines or ["no output"])[-1][-500:], "returncode": proc.returncode}
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--ns-method", default="gram")
    parser.add_argument("--deepspeed-python", default="/work/dsvenv/bin/python")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "deepspeed_muon.json"))
    args = parser.parse_args()
    common = ["--steps", str(args.steps), "--ns-method", args.ns_method]
    threads = {"OMP_NUM_THREADS": "1"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in args.stages:
            ds_out, zs_out = Path(tmp) / f"ds{stage}.json", Path(tmp) / f"zs{stage}.json"
            deepspeed = run([args.deepspeed_python, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), str(SCRIPT), "--stage", str(stage), *common,
                             "--out", str(ds_out)], ds_out,
                            {**threads, "DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": ""})
            zeroshard = run([sys.executable, "-m", "zeroshard.tools.cli", "run", "--as-deepspeed", "--num_gpus", "2",
                             "--master_port", str(free_port()), str(SCRIPT), "--stage", str(stage), *common,
                             "--out", str(zs_out)], zs_out, {**threads, "PYTHONPATH": str(ROOT)})
            row: dict[str, Any] = {"stage": stage, "ns_method": args.ns_method, "steps": args.steps,
                                   "deepspeed": deepspeed, "zeroshard": zeroshard}
            if "losses" in deepspeed and "losses" in zeroshard:
                pairs = list(zip(deepspeed["losses"], zeroshard["losses"]))
                row["max_rel_diff"] = max(abs(z - d) / abs(d) for d, z in pairs)
                row["final"] = pairs[-1]
                for step, (d, z) in enumerate(pairs):
                    print(f"stage {stage} step {step:2d}: DeepSpeed {d:.6f}  zeroshard {z:.6f}  "
                          f"rel {abs(z - d) / abs(d):.2e}", flush=True)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("deepspeed", "zeroshard")}
                             | {"deepspeed_error": deepspeed.get("error"), "zeroshard_error": zeroshard.get("error")}),
                  flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print("| stage | DeepSpeed final loss | zeroshard final loss | max relative difference over the steps |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        if "final" in r:
            print(f"| {r['stage']} | {r['final'][0]:.5f} | {r['final'][1]:.5f} | {r['max_rel_diff']:.2e} |")
        else:
            print(f"| {r['stage']} | {r['deepspeed'].get('error', '')} | {r['zeroshard'].get('error', '')} | - |")


if __name__ == "__main__":
    main()
