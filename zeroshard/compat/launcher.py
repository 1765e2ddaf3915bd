"""``zeroshard run``'s DeepSpeed-launcher flags, translated to torchrun's (the launcher stays torchrun).

    zeroshard run --as-deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json

- ``--num_gpus N`` is torchrun's ``--nproc_per_node N`` (processes on this node: GPUs when there are
  GPUs, CPU processes otherwise); ``--master_port`` / ``--master_addr`` are passed on;
  ``--num_nodes 1`` is accepted; more nodes need torchrun's rendezvous flags (``--nnodes``,
  ``--rdzv-backend``, ``--rdzv-endpoint``), which pass through unchanged, as does every torchrun flag.
- ``--as-deepspeed`` runs the script through :mod:`zeroshard.compat.bootstrap` in every rank, so an
  unmodified ``import deepspeed`` script trains on zeroshard (and gets ``--local_rank`` as from the
  ``deepspeed`` launcher).

Only flags before the script are read; everything from the script on is the script's.
"""

from __future__ import annotations

from typing import Sequence

_VALUE_FLAGS = {"--num_gpus": "--nproc_per_node", "--num-gpus": "--nproc_per_node",
                "--master_port": "--master_port", "--master-port": "--master_port",
                "--master_addr": "--master_addr", "--master-addr": "--master_addr",
                "--num_nodes": None, "--num-nodes": None}


class LauncherArgumentError(ValueError):
    """A launcher flag zeroshard cannot honour, with the torchrun flag to use instead."""


def _script_index(argv: Sequence[str]) -> int:
    for i, arg in enumerate(argv):
        if arg.endswith(".py") and not argv[i - 1:i] == ["--master_addr"]:
            return i
    return len(argv)


def torchrun_arguments(argv: Sequence[str]) -> list[str]:
    """torchrun's argument list for ``zeroshard run ARGV``."""
    cut = _script_index(argv)
    launcher, script = list(argv[:cut]), list(argv[cut:])
    out: list[str] = []
    as_deepspeed = False
    i = 0
    while i < len(launcher):
        arg = launcher[i]
        name, _, inline = arg.partition("=")
        if arg == "--as-deepspeed":
            as_deepspeed = True
        elif name in _VALUE_FLAGS:
            if not inline:
                if i + 1 >= len(launcher):
                    raise LauncherArgumentError(f"{name} needs a value")
                i += 1
                inline = launcher[i]
            target = _VALUE_FLAGS[name]
            if target is None:  # --num_nodes
                if inline != "1":
                    raise LauncherArgumentError(
                        f"{name} {inline}: for several nodes use torchrun's rendezvous flags, e.g. `zeroshard run "
                        f"--nnodes {inline} --node-rank I --rdzv-backend c10d --rdzv-endpoint HOST:PORT ...`")
            else:
                out += [target, inline]
        else:
            out.append(arg)
        i += 1
    if as_deepspeed:
        if not script:
            raise LauncherArgumentError("--as-deepspeed needs a script (a .py file) to run")
        out += ["-m", "zeroshard.compat.bootstrap"]
    return out + script
