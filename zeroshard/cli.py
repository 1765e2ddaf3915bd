"""The ``zeroshard`` command.

    zeroshard demo [--stage 3] [--nproc 2] [--steps 300] [--config ds.json]
    zeroshard consolidate CKPT_DIR OUT [--dtype fp32|bf16|fp16] [--tag TAG]
    zeroshard ckpt-info CKPT_DIR [--tag TAG]
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
    command += ["--out", args.out]
    print("+ " + " ".join(command), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(command, env=env)


def _consolidate(args: argparse.Namespace) -> int:
    from .checkpoint import consolidate

    target = consolidate(args.checkpoint, args.out, dtype=args.dtype, tag=args.tag)
    print(f"wrote {target}")
    return 0


def _ckpt_info(args: argparse.Namespace) -> int:
    from .checkpoint import describe

    print(describe(args.checkpoint, tag=args.tag))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeroshard", description="ZeRO sharded data-parallel training")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a byte-level GPT on the Python stdlib with N CPU processes")
    demo.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage (default 3)")
    demo.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    demo.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    demo.add_argument("--config", help="a DeepSpeed-style JSON config to use instead of the built-in one")
    demo.add_argument("--out", default="runs/demo", help="where the checkpoint and the weights go (runs/demo)")
    demo.set_defaults(run=_demo)
    cons = commands.add_parser("consolidate", help="write a checkpoint's full weights as one safetensors file "
                                                   "(no process group, bounded memory)")
    cons.add_argument("checkpoint", help="a checkpoint directory, or a save_dir with a 'latest' file")
    cons.add_argument("out", help="OUT.safetensors, or a directory (model.safetensors + config.json for HF models)")
    cons.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    cons.add_argument("--tag", help="which tag under a save_dir (default: latest)")
    cons.set_defaults(run=_consolidate)
    info = commands.add_parser("ckpt-info", help="print what a checkpoint holds (and verify its checksums)")
    info.add_argument("checkpoint")
    info.add_argument("--tag")
    info.set_defaults(run=_ckpt_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .checkpoint import CheckpointError

    try:
        return int(args.run(args))
    except CheckpointError as err:
        print(f"zeroshard {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
