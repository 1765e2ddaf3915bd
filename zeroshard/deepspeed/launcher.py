"""``zeroshard run``'s DeepSpeed-launcher flags, translated to torchrun's (the launcher stays torchrun).

    zeroshard run --as-deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json

- ``--num_gpus N`` is torchrun's ``--nproc_per_node N`` (processes on this node: GPUs when there are
  GPUs, CPU processes otherwise); ``--master_port`` / ``--master_addr`` are passed on;
  ``--num_nodes 1`` is accepted; more nodes need torchrun's rendezvous flags (``--nnodes``,
  ``--rdzv-backend``, ``--rdzv-endpoint``), which pass through unchanged, as does every torchrun flag.
- ``--as-deepspeed`` runs the script through :mod:`zeroshard.deepspeed.bootstrap` in every rank, so an
  unmodified ``import deepspeed`` script trains on zeroshard (and gets ``--local_rank`` as from the
  ``deepspeed`` launcher).

Only flags before the script are read; everything from the script on is the script's.

[Note: restarts need a fresh store]
With ``--max-restarts N`` torchrun restarts every worker after a failure, and the new workers meet in
the TCPStore that torchrun's agent keeps for the whole job (torch shares it by default since 2.5).
The previous attempt's keys are still there: a new worker can read a dead worker's address and fail
with "Gloo connectFullMesh failed ... Connection refused", or wait forever (the static rendezvous);
pytorch/pytorch#135712 and #167288 describe it.  ``zeroshard run`` therefore sets torch's own opt-out,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless the user set it), so each attempt's rank 0 hosts a
fresh store, and gives a one-node job that asks for restarts torchrun's ``--standalone`` rendezvous
(the c10d one, where that opt-out applies) unless rendezvous flags are given.
"""

from __future__ import annotations

from typing import Mapping, Sequence

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
    if _asks_for_restarts(out) and not _chooses_rendezvous(out):
        out.insert(0, "--standalone")  # see [Note: restarts need a fresh store]
    if as_deepspeed:
        if not script:
            raise LauncherArgumentError("--as-deepspeed needs a script (a .py file) to run")
        out += ["-m", "zeroshard.deepspeed.bootstrap"]
    return out + script


_RENDEZVOUS_FLAGS = {"--standalone", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint",
                     "--master_addr", "--master-addr", "--master_port", "--master-port"}


def _chooses_rendezvous(args: Sequence[str]) -> bool:
    """The user picked the rendezvous (or several nodes, which need one of their own)."""
    for i, arg in enumerate(args):
        name, _, inline = arg.partition("=")
        if name in _RENDEZVOUS_FLAGS:
            return True
        if name == "--nnodes" and (inline or (args[i + 1] if i + 1 < len(args) else "1")) != "1":
            return True
    return False


def _asks_for_restarts(args: Sequence[str]) -> bool:
    for i, arg in enumerate(args):
        name, _, inline = arg.partition("=")
        if name in ("--max-restarts", "--max_restarts"):
            value = inline or (args[i + 1] if i + 1 < len(args) else "0")
            return value.isdigit() and int(value) > 0
    return False


def torchrun_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's environment: the caller's, with a fresh store per restart (see the Note)."""
    env = dict(environ)
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env
