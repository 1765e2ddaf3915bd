"""Run an unmodified DeepSpeed script on zeroshard: ``python -m zeroshard.deepspeed.bootstrap script.py ARGS``.

``zeroshard run --as-deepspeed`` launches this module in every rank (``torchrun -m``).  It installs
zeroshard as ``deepspeed``, then runs the script as ``__main__`` with its own arguments.  Like the
``deepspeed`` launcher, it passes ``--local_rank=N`` to a script that declares that option; a script
that does not declare it would reject it, so the option is added only when the script's source
mentions ``--local_rank`` (or ``--local-rank``).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from .install import install_as_deepspeed


def script_argv(script: str, args: list[str]) -> list[str]:
    """``sys.argv`` for the script: its arguments, plus ``--local_rank=N`` where it declares one."""
    source = Path(script).read_text(errors="replace")
    declares = "--local_rank" in source or "--local-rank" in source
    given = any(a.startswith(("--local_rank", "--local-rank")) for a in args)
    extra = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"] if declares and not given else []
    return [script, *extra, *args]


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m zeroshard.deepspeed.bootstrap script.py [script args...]")
    install_as_deepspeed()
    script = sys.argv[1]
    sys.argv = script_argv(script, sys.argv[2:])
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
