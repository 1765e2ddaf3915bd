"""DeepSpeed's ``deepspeed.checkpoint.ds_to_universal``: a DeepSpeed checkpoint turned into DeepSpeed's
universal checkpoint folder, without DeepSpeed (see [Note: DeepSpeed's universal layout] in
checkpoint/deepspeed_format/universal.py)::

    python -m zeroshard.checkpoint.ds_to_universal --input_folder ckpt/global_step3 \\
        --output_folder ckpt/global_step3_universal

(``python -m deepspeed.checkpoint.ds_to_universal`` under ``install_as_deepspeed()``.)  DeepSpeed's
options for its worker pools and checks (``--num_extract_workers``, ``--num_merge_workers``,
``--keep_temp_folder``, ``--no_strict``, ``--inject_missing_state``) are accepted: the conversion runs in
one process and needs no ``universal_checkpoint_info`` in the files of one tensor-parallel rank.

A checkpoint of an AutoTP job (``mp_rank_<tp>`` files, ``tp`` above 0; ZeRO 1-3, one pipeline stage) is
joined across both its data- and tensor-parallel ranks by its ``universal_checkpoint_info``
(deepspeed_format/universal_tp.py); ``--keep_temp_folder`` keeps its working folder and ``--no_strict``
lets patterns that matched no parameter pass.  The private names DeepSpeed's tools and tests reach into
(``merge_tp_slices``, ``_merge_zero_shards``, ``_group_per_tp_shapes``, ...) are here too, each
zeroshard's own function.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Optional, Sequence

from .constants import OPTIMIZER_STATE_DICT, UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY, \
    UNIVERSAL_CHECKPOINT_VERSION_VALUE, ZERO_STAGE
from .deepspeed_format.ds_checkpoint import DeepSpeedCheckpoint
from .deepspeed_format.fragments import group_per_tp_shapes as _group_per_tp_shapes
from .deepspeed_format.fragments import merge_zero_shards as _merge_zero_shards
from .deepspeed_format.layout_metadata import aggregate_autoep_zero12_metadata as _aggregate_autoep_zero12_metadata
from .deepspeed_format.tp_layout import check_conversion_support as _validate_autotp_conversion_support
from .deepspeed_format.tp_merge import merge_tp_slices
from .deepspeed_format.universal import write_universal
from .deepspeed_format.universal_tp import rank_grid, write_universal_tp_stage3, write_universal_tp_stage12
from .deepspeed_format.unpickle import load_deepspeed_file
from .utils import rank_order

#: with DeepSpeed's private names, which its tools and tests import from this module
__all__ = ["parse_arguments", "main", "merge_tp_slices", "DeepSpeedCheckpoint", "_group_per_tp_shapes",
           "_merge_zero_shards", "_validate_autotp_conversion_support", "_aggregate_autoep_zero12_metadata"]


def _files(folder: str, suffix: str) -> list[str]:
    """``folder``'s files ending in ``suffix``, in rank order (rank 10 after rank 9)."""
    return [str(p) for p in sorted(Path(folder).glob(f"*{suffix}"), key=lambda p: rank_order(p.name))]


def _get_optim_files(checkpoint_dir: str) -> list[str]:
    return _files(checkpoint_dir, "_optim_states.pt")


def _filter_zero3_optim_files(optim_files: Sequence[str]) -> list[str]:
    return [f for f in optim_files if re.match(r"(?:bf16_)?zero_pp_rank_", Path(f).name)]


def _get_zero_stage(optim_files: Sequence[str]) -> int:
    return int(load_deepspeed_file(Path(optim_files[0]))[OPTIMIZER_STATE_DICT].get(ZERO_STAGE, 1))


def _inject_missing_state(checkpoint: DeepSpeedCheckpoint) -> None:
    """Give a checkpoint without ``universal_checkpoint_info`` an empty one of the current version."""
    if checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO) is None:
        checkpoint.global_state[UNIVERSAL_CHECKPOINT_INFO] = {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}


def _check_for_required_state(checkpoint: DeepSpeedCheckpoint) -> None:
    """Refuse layouts AutoTP marked unconvertible; a checkpoint without the info converts as one
    tensor-parallel rank."""
    _validate_autotp_conversion_support(checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO) or {})


def _zero3_model_files(checkpoint_dir: str) -> list[str]:
    return [f for f in _files(checkpoint_dir, "_model_states.pt")
            if not (Path(f).name.startswith("layer_") and "_expert_" in Path(f).name)]


def parse_arguments(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="a DeepSpeed checkpoint as DeepSpeed's universal checkpoint")
    parser.add_argument("--input_folder", type=str, required=True, help="the DeepSpeed checkpoint's tag folder")
    parser.add_argument("--output_folder", type=str, required=True, help="the universal checkpoint folder")
    parser.add_argument("--num_extract_workers", type=int, default=4, help="accepted; one process converts")
    parser.add_argument("--num_merge_workers", type=int, default=2, help="accepted; one process converts")
    parser.add_argument("--keep_temp_folder", action="store_true",
                        help="keep the working folder of a tensor-parallel conversion (tmp/ in the output)")
    parser.add_argument("--no_strict", dest="strict", action="store_false",
                        help="let universal_checkpoint_info patterns that match no parameter pass")
    parser.add_argument("--inject_missing_state", action="store_true",
                        help="accepted; a checkpoint without universal_checkpoint_info converts as one tensor rank")
    return parser.parse_args(argv)


def _convert(args: argparse.Namespace) -> None:
    input_folder, output_folder = args.input_folder, Path(args.output_folder)
    strict, keep = getattr(args, "strict", True), getattr(args, "keep_temp_folder", False)
    optim_files = _get_optim_files(input_folder)
    zero3_files = _filter_zero3_optim_files(optim_files)
    stage = _get_zero_stage(zero3_files or optim_files) if optim_files else 0
    if 0 < stage <= 2:
        checkpoint = DeepSpeedCheckpoint(input_folder)
        if getattr(args, "inject_missing_state", False):
            _inject_missing_state(checkpoint)
        _check_for_required_state(checkpoint)
        if checkpoint.tp_degree > 1:
            write_universal_tp_stage12(checkpoint, output_folder, strict=strict, keep_work_folder=keep)
            return
    if stage == 3 and zero3_files:
        model_files = _zero3_model_files(input_folder)
        if model_files and rank_grid(model_files)[1] > 1:
            write_universal_tp_stage3(model_files, zero3_files, output_folder, strict=strict, keep_work_folder=keep)
            return
    write_universal(Path(input_folder), output_folder)


def main(args: argparse.Namespace) -> None:
    """Convert ``args.input_folder`` into ``args.output_folder`` (``latest_universal`` beside it names it)."""
    print(f"Converting DeepSpeed checkpoint in {args.input_folder} to Universal checkpoint in {args.output_folder}")
    _convert(args)
    print("*** Done!")


if __name__ == "__main__":
    main(parse_arguments())
