"""The ``zeroshard`` command.

    zeroshard demo [--stage 3] [--nproc 2] [--steps 300] [--config ds.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Sequence


def _demo(args: argparse.Namespace) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc}", "-m", "zeroshard.demo.train",
               "--stage", str(args.stage), "--steps", str(args.steps)]
    if args.config:
        command += ["--config", args.config]
    print("+ " + " ".join(command), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(command, env=env)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeroshard", description="ZeRO sharded data-parallel training")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a byte-level GPT on the Python stdlib with N CPU processes")
    demo.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage (default 3)")
    demo.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    demo.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    demo.add_argument("--config", help="a DeepSpeed-style JSON config to use instead of the built-in one")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
