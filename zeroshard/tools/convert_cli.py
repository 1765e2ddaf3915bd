"""``zeroshard convert``: DeepSpeed's checkpoints into zeroshard's format, and any checkpoint into
DeepSpeed's layout or its universal folder (zeroshard/checkpoint/deepspeed_format/convert.py)."""

from __future__ import annotations

import argparse
from typing import Any


def _convert(args: argparse.Namespace) -> int:
    from ..checkpoint.deepspeed_format.convert import convert_deepspeed, convert_to_deepspeed, convert_to_universal

    if args.to == "universal":
        target = convert_to_universal(args.checkpoint, args.out, args.world_size or 1, args.stage or 2, args.dtype,
                                      args.tag)
        print(f"wrote {target} (DeepSpeed's universal checkpoint; 'latest_universal' names it)")
        return 0
    if args.to == "deepspeed":
        if args.world_size is None or args.stage is None:
            raise SystemExit("zeroshard convert --to deepspeed: give --world-size and --stage (DeepSpeed loads a "
                             "ZeRO checkpoint only at the world size and stage its files name)")
        target = convert_to_deepspeed(args.checkpoint, args.out, args.world_size, args.stage, args.dtype, args.tag)
        print(f"wrote {target} (DeepSpeed's layout: {args.world_size} ranks, ZeRO stage {args.stage})")
        return 0
    target, left_out = convert_deepspeed(args.checkpoint, args.out, tag=args.tag)
    print(f"wrote {target}" + (f" (client state not JSON, left out: {', '.join(left_out)})" if left_out else ""))
    return 0


def add_convert(commands: Any) -> None:
    """The ``convert`` subcommand, on the ``zeroshard`` command's subparsers."""
    conv = commands.add_parser("convert", help="rewrite a DeepSpeed checkpoint in zeroshard's format, or any "
                                               "checkpoint in DeepSpeed's (--to deepspeed), offline")
    conv.add_argument("checkpoint", help="a save_dir (with 'latest'), or one tag's directory")
    conv.add_argument("out", help="the save_dir to write (the same tag, 'latest' naming it)")
    conv.add_argument("--tag", help="which tag under the save_dir (default: latest)")
    conv.add_argument("--to", choices=["zeroshard", "deepspeed", "universal"], default="zeroshard",
                      help="zeroshard (from DeepSpeed's layout; the default), deepspeed or universal (DeepSpeed's "
                           "universal folder; from either)")
    conv.add_argument("--world-size", type=int, help="--to deepspeed: the data-parallel ranks that will load it "
                                                     "(--to universal from zeroshard's format: of its model files, 1)")
    conv.add_argument("--stage", type=int, choices=[1, 2, 3], help="--to deepspeed: the ZeRO stage that will load it "
                                                                   "(--to universal from zeroshard's format: 2)")
    conv.add_argument("--dtype", choices=["fp32", "bf16"],
                      help="--to deepspeed: the training precision (default: the checkpoint's)")
    conv.set_defaults(run=_convert)
