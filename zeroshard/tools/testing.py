"""Run a function in a real world of N gloo processes on CPU: the harness behind zeroshard's tests.

    results = run_world(my_worker, world_size=3, args=(stage,))
    results = run_world(my_worker, world_size=1, backend="nccl")   # one rank per GPU (benchmarks on a GPU)

One world serves a family of cases.  ``run_family`` runs named cases in turn in one world (each
from the same seed, named in anything it raises), and ``check_family`` checks each case's results
from every rank under ``CaseFailures``, so that every failing case is reported, each by its name:

    WORKERS = {"matches_ddp": matches_ddp_worker}       # module-level: worker(rank, world, **arguments)
    CHECKS = {"matches_ddp": check_matches_ddp}         # check(results_by_rank, **arguments)
    cases = [("matches_ddp", {"stage": 2}), ("matches_ddp", {"stage": 3})]
    check_family(cases, run_family(2, cases, WORKERS), CHECKS, world=2)

A worker that loops by itself can use ``case(stage=2, precision="bf16")`` and ``CaseFailures`` directly.

``my_worker(rank, world_size, *args)`` must be importable (a module-level function): each process is
forked from a server that has imported torch and zeroshard (see [Note: ranks forked from a preloaded
server]), joins a gloo process group on a free localhost port, runs it with one
intra-op thread, and sends back its return value (or its traceback).  A port clash is retried with a
new port; a world that outlives ``timeout`` is killed and reported, so a hang fails a test instead of
stalling the suite.  ``backend="nccl"``: rank r trains on GPU ``LOCAL_RANK`` (r), set as its current device
before the group is made, and is started by ``spawn`` (a rank forked from a process that has touched
CUDA cannot use it).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

PORT_CLASH_MARKERS = ("address already in use", "EADDRINUSE", "errno: 98")


class WorldFailed(AssertionError):
    """A rank raised, died or timed out; the message holds every failing rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: Sequence[Any],
           results: Any, pg_timeout_s: float, env: dict[str, str], ranks_per_node: Optional[int],
           backend: str = "gloo") -> None:
    # A forked rank starts with the fork server's environment: give it the caller's as it is now.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    if ranks_per_node is not None:  # what torchrun tells the workers of one of several agents (nodes)
        os.environ.update(LOCAL_RANK=str(rank % ranks_per_node), LOCAL_WORLD_SIZE=str(ranks_per_node),
                          GROUP_RANK=str(rank // ranks_per_node), GROUP_WORLD_SIZE=str(world_size // ranks_per_node))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle (by value): the queue's own pickler would pass tensors through shared memory
        # that disappears with this process.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))


PRELOADED = ["torch", "torch.distributed", "zeroshard"]


def _context(spawn: bool) -> Any:
    """How ranks are started: forked from a server that has imported torch and zeroshard once.

    [Note: ranks forked from a preloaded server]
    Importing torch costs a rank about two CPU-seconds, more than most cases of a family take, and
    a world's ranks import it side by side on two cores.  A fork server (``forkserver``: a clean
    single-threaded process, never the test process itself) imports torch and zeroshard once and
    forks every rank from there.  Variables that the C runtime reads when a process starts
    (``MALLOC_*``, ``OMP_*``) cannot reach a forked rank, so a world given such an ``env`` is started
    with ``spawn`` instead, and so is a world on GPUs (CUDA does not survive a fork).
    """
    if spawn:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    return ctx


def _drain(results: Any, collected: dict[int, tuple[str, Any]], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            rank, status, value = results.get(timeout=max(0.05, end - time.monotonic()))
            collected[rank] = (status, value)
        except queue.Empty:
            return


def run_world(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout: float = 300.0,
              pg_timeout_s: float = 120.0, retries: int = 3, env: dict[str, str] | None = None,
              ranks_per_node: Optional[int] = None, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return the values by rank.

    ``ranks_per_node``: each process is told (as torchrun tells it) that it is on node
    ``rank // ranks_per_node``, so that zeroshard sees several nodes (bytes across nodes, hybrid groups).
    """
    last_error = ""
    for _ in range(retries):
        try:
            return _run_once(fn, world_size, args, timeout, pg_timeout_s, env or {}, ranks_per_node, backend)
        except WorldFailed as failure:
            last_error = str(failure)
            if not any(marker in last_error for marker in PORT_CLASH_MARKERS):
                raise
    raise WorldFailed(f"port clash persisted after {retries} tries:\n{last_error}")


def _run_once(fn: Callable[..., Any], world_size: int, args: Sequence[Any], timeout: float,
              pg_timeout_s: float, env: dict[str, str], ranks_per_node: Optional[int] = None,
              backend: str = "gloo") -> list[Any]:
    ctx = _context(spawn=bool(env) or backend != "gloo")
    results = ctx.Queue()
    port = free_port()
    child_env = {**os.environ, **env}
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, results, pg_timeout_s, child_env,
                                              ranks_per_node, backend),
                         daemon=True) for r in range(world_size)]
    # Variables read at process start (MALLOC_*, OMP_*) must be in the environment the children are
    # started with, not set after: put them in ours while starting them.
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    collected: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorldFailed(f"world of {world_size} timed out after {timeout:.0f}s; "
                                  f"finished ranks: {sorted(collected)}")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
                collected[rank] = (status, value)
                if status == "error":
                    # The other ranks may be stuck in a collective: do not wait for them, but give
                    # the rank that caused it (often not the first to report) a moment to say so.
                    _drain(results, collected, seconds=3.0)
                    break
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in collected
                        and p.exitcode not in (0, None)]
                if dead:
                    time.sleep(0.5)  # give a dying rank's message a moment to arrive
                    while not results.empty():
                        rank, status, value = results.get()
                        collected[rank] = (status, value)
                    dead = [r for r in dead if r not in collected]
                    if dead:
                        raise WorldFailed(f"rank(s) {dead} died with exit codes "
                                          f"{[procs[r].exitcode for r in dead]}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(collected.items()) if s == "error"]
    if errors:
        raise WorldFailed("\n".join(errors))
    return [pickle.loads(collected[r][1]) for r in range(world_size)]


def case_name(**labels: Any) -> str:
    """``stage 2, world 3, precision bf16``: how a case is named in failures."""
    return ", ".join(f"{key} {value}" for key, value in labels.items())


class CaseFailed(AssertionError):
    """A case of a family run in one world raised; the message starts with the case's name."""


@contextmanager
def case(**labels: Any) -> Iterator[None]:
    """In a worker: run one case of a family, naming it in anything it raises."""
    try:
        yield
    except BaseException as error:
        raise CaseFailed(f"[{case_name(**labels)}] {type(error).__name__}: {error}") from error


class CaseFailures:
    """In a test: check every case of a family and report all that fail, each by its name.

        failures = CaseFailures()
        for stage in (0, 1, 2):
            with failures.case(stage=stage, world=world):
                assert diff[stage] <= 1e-5
        failures.raise_any()
    """

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.checked = 0

    @contextmanager
    def case(self, **labels: Any) -> Iterator[None]:
        self.checked += 1
        try:
            yield
        except AssertionError as error:
            self.failed.append(f"[{case_name(**labels)}] {error}")

    def raise_any(self) -> None:
        assert self.checked, "no case was checked"
        if self.failed:
            raise AssertionError(f"{len(self.failed)} of {self.checked} cases failed:\n" + "\n".join(self.failed))


#: one case of a family: the name of its worker and check, and their keyword arguments
Case = tuple[str, dict[str, Any]]
#: how a case is named in failures, from its name, the world size and its arguments
Labels = Callable[[str, int, dict[str, Any]], dict[str, Any]]


def default_labels(name: str, world: int, arguments: dict[str, Any]) -> dict[str, Any]:
    """``check <name>, world <n>``, then the case's arguments (stage, precision, ...)."""
    return {"check": name, "world": world, **arguments}


def case_directory(root: Path, index: int) -> Path:
    """The directory of a family's case ``index`` (its checkpoints, swap files, ...)."""
    return root / f"case{index}"


def run_cases(rank: int, world: int, cases: Sequence[Case], workers: Mapping[str, Callable[..., Any]],
              labels: Labels, root: Optional[str]) -> list[Any]:
    """In every rank: each case in turn, from the same seed, named in anything it raises; results in case
    order.  With ``root``, a case's worker gets its directory as its third argument."""
    import torch

    results = []
    for index, (name, arguments) in enumerate(cases):
        torch.manual_seed(0)
        directory = () if root is None else (str(case_directory(Path(root), index)),)
        with case(**labels(name, world, arguments)):
            results.append(workers[name](rank, world, *directory, **arguments))
    return results


def run_named_cases(rank: int, world: int, cases: Mapping[str, tuple[Callable[..., Any], tuple]]) -> dict[str, Any]:
    """In every rank: ``run(rank, world, *args)`` for each named case in turn, named in anything it
    raises; results by name (for families whose cases are different functions with positional arguments)."""
    out = {}
    for name, (run, args) in cases.items():
        with case(case=name, world=world):
            out[name] = run(rank, world, *args)
    return out


def run_family(world_size: int, cases: Sequence[Case], workers: Mapping[str, Callable[..., Any]],
               labels: Labels = default_labels, root: Optional[Path] = None, timeout: float = 600.0,
               **world_options: Any) -> list[list[Any]]:
    """Run a family of cases in one world of ``world_size``; each rank's results, in case order.
    ``workers`` must be module-level functions (they travel to the spawned ranks by name); with ``root``
    each case gets a directory of its own, made here."""
    if root is not None:
        for index in range(len(cases)):
            case_directory(root, index).mkdir(parents=True, exist_ok=True)
    by_rank = run_world(run_cases, world_size, args=(list(cases), dict(workers), labels,
                                                     None if root is None else str(root)),
                        timeout=timeout, **world_options)
    assert all(len(results) == len(cases) for results in by_rank), "a rank skipped a case"
    return by_rank


def check_family(cases: Sequence[Case], by_rank: list[list[Any]], checks: Mapping[str, Callable[..., None]],
                 world: int, labels: Labels = default_labels, root: Optional[Path] = None,
                 more: Optional[Mapping[int, dict[str, Any]]] = None) -> None:
    """Check every case: ``checks[name](results_by_rank, [directory,] **arguments, **more[index])``,
    reporting every failing case by its name."""
    failures = CaseFailures()
    for index, (name, arguments) in enumerate(cases):
        directory = () if root is None else (case_directory(root, index),)
        with failures.case(**labels(name, world, arguments)):
            checks[name]([results[index] for results in by_rank], *directory, **arguments,
                         **(more or {}).get(index, {}))
    failures.raise_any()
