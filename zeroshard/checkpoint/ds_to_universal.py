"""DeepSpeed's ``deepspeed.checkpoint.ds_to_universal``: a DeepSpeed checkpoint turned into DeepSpeed's
universal checkpoint folder, without DeepSpeed (see [Note: DeepSpeed's universal layout] in
checkpoint/deepspeed_format/universal.py)::

    python -m zeroshard.checkpoint.ds_to_universal --input_folder ckpt/global_step3 \\
        --output_folder ckpt/global_step3_universal

(``python -m deepspeed.checkpoint.ds_to_universal`` under ``install_as_deepspeed()``.)  DeepSpeed's
options for its worker pools and checks (``--num_extract_workers``, ``--num_merge_workers``,
``--keep_temp_folder``, ``--no_strict``, ``--inject_missing_state``) are accepted: the conversion runs in
one process, keeps no temporary folder, and needs no ``universal_checkpoint_info`` in the files.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from .deepspeed_format.layout_metadata import aggregate_autoep_zero12_metadata as _aggregate_autoep_zero12_metadata
from .deepspeed_format.universal import write_universal

__all__ = ["parse_arguments", "main", "_aggregate_autoep_zero12_metadata"]


def parse_arguments(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="a DeepSpeed checkpoint as DeepSpeed's universal checkpoint")
    parser.add_argument("--input_folder", type=str, required=True, help="the DeepSpeed checkpoint's tag folder")
    parser.add_argument("--output_folder", type=str, required=True, help="the universal checkpoint folder")
    parser.add_argument("--num_extract_workers", type=int, default=4, help="accepted; one process converts")
    parser.add_argument("--num_merge_workers", type=int, default=2, help="accepted; one process converts")
    parser.add_argument("--keep_temp_folder", action="store_true", help="accepted; no temporary folder is made")
    parser.add_argument("--no_strict", dest="strict", action="store_false", help="accepted")
    parser.add_argument("--inject_missing_state", action="store_true",
                        help="accepted; the conversion needs no universal_checkpoint_info")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> None:
    """Convert ``args.input_folder`` into ``args.output_folder`` (``latest_universal`` beside it names it)."""
    print(f"Converting DeepSpeed checkpoint in {args.input_folder} to Universal checkpoint in {args.output_folder}")
    write_universal(Path(args.input_folder), Path(args.output_folder))
    print("*** Done!")


if __name__ == "__main__":
    main(parse_arguments())
