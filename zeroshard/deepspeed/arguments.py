"""``deepspeed.add_config_arguments(parser)``: the command-line flags DeepSpeed scripts declare."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--deepspeed`` and ``--deepspeed_config`` (plus DeepSpeed's older ``--deepscale`` spellings);
    ``initialize(args=args)`` then reads the config from ``args.deepspeed_config``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (zeroshard)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Train with zeroshard (the flag DeepSpeed scripts check)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed-style JSON config file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
