"""``zeroshard selftest``: decide the device and the ranks, launch the workers with torchrun, judge and
report what rank 0 wrote.

    zeroshard selftest [--device cpu|cuda] [--nproc N] [--size 125m] [--steps K] [--json out.json]

The launch is ``zeroshard run``'s (deepspeed/launcher.py's torchrun arguments and environment), one
node by torchrun's ``--standalone`` unless ``--torchrun-args`` gives a rendezvous of its own; the
table goes to stdout, the JSON and a plot beside it where ``--json`` says; the exit status is 1 when a
correctness or memory check fails (and the ranks' own when they fail), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from ...deepspeed.launcher import torchrun_arguments, torchrun_environment
from ..plots import plot_selftest
from .report import format_report
from .sizes import PRESETS, pick_size
from .verdict import judge

#: the defaults where the run is on the CPU: a model and a step count that finish in a minute or two
CPU_DEFAULTS: dict[str, Any] = {"size": "tiny", "steps": 5, "warmup": 2, "precision": "fp32"}
CUDA_DEFAULTS: dict[str, Any] = {"size": "125m", "steps": 10, "warmup": 3, "precision": "bf16"}


def add_parser(commands: Any) -> None:
    """The ``selftest`` subcommand on the ``zeroshard`` command's subparsers."""
    parser = commands.add_parser(
        "selftest", help="check a machine: correctness of stages 0-3 against PyTorch, memory against the "
                         "formulas, host syncs, collective bandwidth, tokens/s beside PyTorch and FSDP2")
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        help="where the ranks train (default: cuda when there is a GPU, else cpu)")
    parser.add_argument("--nproc", type=int,
                        help="ranks on this node (default: every GPU on cuda, 2 on cpu; at most the GPUs)")
    parser.add_argument("--size", help=f"the throughput and memory model: {', '.join(PRESETS)}, or a parameter "
                                       f"count (the nearest preset); default tiny on cpu, 125m on cuda")
    parser.add_argument("--precision", choices=["fp32", "bf16"],
                        help="of the throughput and memory runs (default bf16 on cuda, fp32 on cpu; the "
                             "correctness cases run both)")
    parser.add_argument("--steps", type=int, help="timed steps per implementation (default 5 on cpu, 10 on cuda)")
    parser.add_argument("--json", help="write the results here (and the plot beside it, .png)")
    parser.add_argument("--torchrun-args", default="",
                        help="more torchrun options, e.g. several nodes: '--nnodes 2 --node-rank 0 "
                             "--rdzv-backend c10d --rdzv-endpoint HOST:PORT' (replaces --standalone)")
    parser.set_defaults(run=run_selftest)


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(args: argparse.Namespace, cuda_devices: int) -> dict[str, Any]:
    """The run's device, ranks, size, precision and steps from the options and this host; SystemExit with
    the reason for what cannot run here."""
    device = args.device or ("cuda" if cuda_devices else "cpu")
    if device == "cuda" and not cuda_devices:
        raise SystemExit("zeroshard selftest: --device cuda but torch sees no CUDA device here (zeroshard env "
                         "says why); use --device cpu")
    nproc = args.nproc if args.nproc is not None else (cuda_devices if device == "cuda" else 2)
    if nproc < 1:
        raise SystemExit(f"zeroshard selftest: --nproc {nproc}: give at least 1")
    if device == "cuda" and nproc > cuda_devices:
        raise SystemExit(f"zeroshard selftest: --nproc {nproc} but this host has {cuda_devices} CUDA device(s); "
                         f"one rank per GPU: --nproc {cuda_devices} or fewer")
    defaults = CUDA_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    try:
        preset = pick_size(args.size or str(defaults["size"]))
    except ValueError as err:
        raise SystemExit(f"zeroshard selftest: --size {err}") from None
    steps = args.steps if args.steps is not None else int(defaults["steps"])
    if steps < 1:
        raise SystemExit(f"zeroshard selftest: --steps {steps}: give at least 1")
    return {"device": device, "nproc": nproc, "size": preset.name, "steps": steps, "warmup": defaults["warmup"],
            "precision": args.precision or defaults["precision"]}


def torchrun_command(nproc: int, spec_path: str, extra: str = "") -> list[str]:
    """torchrun's arguments for the workers, translated as ``zeroshard run`` translates them."""
    rendezvous = shlex.split(extra) if extra else ["--standalone"]
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_arguments(
        [*rendezvous, f"--nproc_per_node={nproc}", "-m", "zeroshard.tools.selftest.worker", spec_path])]


def worker_environment(device: str) -> dict[str, str]:
    """``zeroshard run``'s environment; on the CPU one intra-op thread per rank (the ranks share the cores)
    and the GPUs hidden, so that the ranks pick gloo and the CPU whatever the host has."""
    env = torchrun_environment(os.environ)
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def launch(run: dict[str, Any], extra: str) -> tuple[int, Optional[dict[str, Any]]]:
    """Run the workers; (their exit status, the results rank 0 wrote or None)."""
    with tempfile.TemporaryDirectory(prefix="zeroshard-selftest-") as tmp:
        results = Path(tmp) / "results.json"
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({**run, "results": str(results)}))
        command = torchrun_command(run["nproc"], str(spec), extra)
        print("+ " + " ".join(command), flush=True)
        code = subprocess.call(command, env=worker_environment(run["device"]))
        return code, json.loads(results.read_text()) if results.is_file() else None


def run_selftest(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    run = resolve(args, _cuda_devices() if args.device != "cpu" else 0)
    code, results = launch(run, args.torchrun_args)
    if results is None:
        if code == 0:  # another node's command: rank 0's node reports
            print("zeroshard selftest: no results on this node; the node of rank 0 reports them")
            return 0
        print(f"zeroshard selftest: the ranks failed (exit status {code}); their output is above", file=sys.stderr)
        return code or 1
    judged, failures = judge(results)
    wall_s = time.perf_counter() - started
    judged["wall_s"] = wall_s
    print(format_report(judged, wall_s))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(judged, indent=1))
        print(f"json: {path}")
        try:
            print(f"plot: {plot_selftest(judged, path.with_suffix('.png'))}")
        except ImportError as err:  # matplotlib is an optional extra
            print(f"no plot: {err}")
    return 1 if failures else (code or 0)
